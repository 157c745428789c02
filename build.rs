//! Records which commit a binary was built from (`RDMACOMM_BUILD`: short hash, "+dirty" when the
//! work tree had changes, "unknown" outside a git checkout), so a benchmark's output names the
//! code that produced it. Nothing else: verbs are loaded at run time, so no native library is
//! linked or probed here.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    // Only this crate's own checkout (not a repository it was vendored into).
    let own = std::path::Path::new(".git").exists();
    let build = match own
        .then(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .flatten()
    {
        Some(hash) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            format!("{hash}{}", if dirty { "+dirty" } else { "" })
        }
        None => "unknown".into(),
    };
    println!("cargo:rustc-env=RDMACOMM_BUILD={build}");
    // Rebuild the stamp when the checked-out commit or the index moves.
    for f in [".git/HEAD", ".git/index"] {
        if std::path::Path::new(f).exists() {
            println!("cargo:rerun-if-changed={f}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
