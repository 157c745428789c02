//! `rdmacomm-run -n N [--max-restarts K] [--] PROG ARGS...`: starts N local ranks of PROG with
//! RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, prefixes their output with the rank, and
//! exits non-zero (stopping the rest) if any rank fails; with `--max-restarts K`, a rank that
//! fails is started again instead (`RDMACOMM_REPLACEMENT=1`), K times in all.

fn usage() -> ! {
    eprintln!("usage: rdmacomm-run -n N [--max-restarts K] [--] PROG [ARGS...]");
    std::process::exit(2)
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut n = None;
    let mut restarts = 0;
    while !args.is_empty() {
        match args[0].as_str() {
            "-n" | "--np" | "--nproc" if args.len() > 1 => {
                n = args[1].parse::<usize>().ok().filter(|&v| v > 0);
                if n.is_none() {
                    eprintln!(
                        "rdmacomm-run: -n takes a positive number, not {:?}",
                        args[1]
                    );
                    std::process::exit(2);
                }
                args.drain(..2);
            }
            "--max-restarts" if args.len() > 1 => {
                restarts = match args[1].parse::<usize>() {
                    Ok(k) => k,
                    Err(_) => {
                        eprintln!(
                            "rdmacomm-run: --max-restarts takes a number, not {:?}",
                            args[1]
                        );
                        std::process::exit(2);
                    }
                };
                args.drain(..2);
            }
            "--" => {
                args.remove(0);
                break;
            }
            "-h" | "--help" => usage(),
            _ => break,
        }
    }
    let Some(n) = n else { usage() };
    if args.is_empty() {
        usage()
    }
    let prog = args.remove(0);
    match rdmacomm::run_local_with(n, &prog, &args, true, restarts) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("rdmacomm-run: {e}");
            std::process::exit(1)
        }
    }
}
