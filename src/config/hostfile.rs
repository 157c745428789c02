//! MLX's hostfile (`MLX_HOSTFILE`, with `MLX_RANK`): the launch of a nuvec or MLX ring job.
//!
//! The file is a JSON list with one entry per rank, each a list of `"host:port"` strings (the
//! ring's addresses of that rank). rdmacomm takes the world size from its length and meets at
//! rank 0's first address.

use crate::error::{Error, Result};

/// The ranks' address lists, as the file gives them.
pub(crate) fn parse(text: &str) -> Result<Vec<Vec<String>>> {
    let mut p = Parser {
        s: text.as_bytes(),
        at: 0,
    };
    let ranks = p.list(|p| p.list(Parser::string))?;
    p.space();
    if p.at != p.s.len() {
        return Err(p.fail("text after the list"));
    }
    Ok(ranks)
}

/// This rank, the world size and where rank 0 listens, from `MLX_RANK` and the hostfile's text.
pub(crate) fn identity(rank: &str, text: &str) -> Result<(usize, usize, String)> {
    let rank: usize = rank
        .trim()
        .parse()
        .map_err(|_| Error::Config(format!("MLX_RANK={rank:?} is not a rank")))?;
    let ranks = parse(text)?;
    let size = ranks.len();
    if rank >= size {
        return Err(Error::Config(format!(
            "MLX_RANK={rank}, but MLX_HOSTFILE lists {size} ranks"
        )));
    }
    let coordinator = ranks[0].first().cloned().ok_or_else(|| {
        Error::Config("MLX_HOSTFILE: rank 0 has no address to meet at".to_string())
    })?;
    Ok((rank, size, coordinator))
}

struct Parser<'a> {
    s: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn space(&mut self) {
        while self.s.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn fail(&self, what: &str) -> Error {
        Error::Config(format!(
            "MLX_HOSTFILE is not a JSON list of lists of \"host:port\" strings: {what} at byte {}",
            self.at
        ))
    }

    fn eat(&mut self, c: u8) -> bool {
        self.space();
        if self.s.get(self.at) == Some(&c) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn list<T>(&mut self, item: impl Fn(&mut Self) -> Result<T>) -> Result<Vec<T>> {
        if !self.eat(b'[') {
            return Err(self.fail("expected '['"));
        }
        let mut v = Vec::new();
        if self.eat(b']') {
            return Ok(v);
        }
        loop {
            v.push(item(self)?);
            if self.eat(b']') {
                return Ok(v);
            }
            if !self.eat(b',') {
                return Err(self.fail("expected ',' or ']'"));
            }
        }
    }

    fn string(&mut self) -> Result<String> {
        if !self.eat(b'"') {
            return Err(self.fail("expected a string"));
        }
        let mut out = Vec::new();
        loop {
            match self.s.get(self.at).copied() {
                None => return Err(self.fail("unterminated string")),
                Some(b'"') => {
                    self.at += 1;
                    return String::from_utf8(out).map_err(|_| self.fail("a string not UTF-8"));
                }
                Some(b'\\') => {
                    let c = match self.s.get(self.at + 1).copied() {
                        Some(c @ (b'"' | b'\\' | b'/')) => c,
                        _ => return Err(self.fail("an escape other than \\\" \\\\ \\/")),
                    };
                    out.push(c);
                    self.at += 2;
                }
                Some(c) => {
                    out.push(c);
                    self.at += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hostfile_gives_rank_size_and_rank_zeros_address() {
        let text =
            " [ [\"10.0.0.1:5000\", \"10.0.1.1:5000\"],\n[\"10.0.0.2:5000\"] ,[\"h\\/3:1\"]] ";
        assert_eq!(
            identity("2", text).unwrap(),
            (2, 3, "10.0.0.1:5000".to_string())
        );
        assert_eq!(parse(text).unwrap()[2], vec!["h/3:1".to_string()]);
    }

    #[test]
    fn a_bad_hostfile_is_named_never_a_panic() {
        for bad in [
            "",
            "[",
            "[[",
            "[[\"a",
            "[[\"a\"",
            "[[1]]",
            "[[\"a\"]] x",
            "{}",
            "[[\"\\n\"]]",
            "[[\"a\",]]",
        ] {
            let e = identity("0", bad).unwrap_err().to_string();
            assert!(e.contains("MLX_HOSTFILE"), "{bad:?}: {e}");
        }
        let e = identity("3", "[[\"a:1\"],[\"b:1\"]]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("lists 2 ranks"), "{e}");
        let e = identity("x", "[[\"a:1\"]]").unwrap_err().to_string();
        assert!(e.contains("MLX_RANK"), "{e}");
        let e = identity("0", "[[]]").unwrap_err().to_string();
        assert!(e.contains("no address"), "{e}");
    }
}
