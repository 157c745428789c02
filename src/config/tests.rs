//! The configuration's unit tests: launchers' variables, settings, the GUIDE's table.

use super::*;

#[test]
fn the_guide_lists_every_setting_and_no_other() {
    let guide = include_str!("../../docs/GUIDE.md");
    let mut listed: Vec<&str> = guide
        .lines()
        .filter(|l| l.starts_with("| `RDMACOMM_"))
        .filter_map(|l| l.split(" | ").next())
        .flat_map(|names| names.split('`').filter(|w| w.starts_with("RDMACOMM_")))
        .collect();
    listed.sort_unstable();
    listed.dedup();
    let mut known: Vec<&str> = VARIABLES.to_vec();
    // The tests' own switch, documented beside the settings.
    known.push("RDMACOMM_REQUIRE_RDMA");
    known.sort_unstable();
    assert_eq!(
        listed, known,
        "docs/GUIDE.md's environment table and VARIABLES differ"
    );
}

#[test]
fn suggestions_pick_the_closest_name() {
    assert_eq!(distance("RDMACOMM_TIMOUT", "RDMACOMM_TIMEOUT"), 1);
    let near = VARIABLES
        .iter()
        .min_by_key(|v| distance("RDMACOMM_ALOG", v))
        .unwrap();
    assert_eq!(*near, "RDMACOMM_ALGO");
}

#[test]
fn settings_parse_or_name_the_accepted_values() {
    assert_eq!(Poll::parse("yield").unwrap(), Poll::Yield);
    let e = Poll::parse("fast").unwrap_err().to_string();
    assert!(
        e.contains("RDMACOMM_POLL=\"fast\"") && e.contains("auto, spin or yield"),
        "{e}"
    );
    assert_eq!(Progress::parse("caller").unwrap(), Progress::Caller);
    let e = Progress::parse("none").unwrap_err().to_string();
    assert!(
        e.contains("RDMACOMM_PROGRESS=\"none\"") && e.contains("thread or caller"),
        "{e}"
    );
    assert_eq!(Bcast::parse("tree").unwrap(), Bcast::Tree);
    let e = Bcast::parse("tre").unwrap_err().to_string();
    assert!(
        e.contains("RDMACOMM_BCAST=\"tre\"") && e.contains("chain, tree or auto"),
        "{e}"
    );
    let d = Config::defaults(0, 2, "127.0.0.1:1");
    assert!(d.validate().is_ok());
    assert!(d.shared_settings().contains("RDMACOMM_ALGO=auto"));
}

/// A lookup over `vars` only (the process's environment untouched).
fn table(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
}

#[test]
fn launchers_without_an_address() {
    // mpirun: no address, PMIx's namespace: rank 0 publishes it there.
    let mpirun = table(&[
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("PMIX_NAMESPACE", "prterun-x-1@1"),
        ("PMIX_RANK", "2"),
    ]);
    let (r, n, c) = identity_from(&mpirun).unwrap();
    assert_eq!((r, n, c.as_str()), (2, 4, ""));
    assert_eq!(discovery_from(&mpirun, &c, n), Discovery::Pmix);
    // Slurm without PMIx: the step's first node, a port from the job and step, alike on
    // every rank and different for another step.
    let slurm = |rank: &str, step: &str| {
        table(&[
            ("SLURM_PROCID", rank),
            ("SLURM_NTASKS", "8"),
            ("SLURM_JOB_ID", "4711"),
            ("SLURM_STEP_ID", step),
            ("SLURM_STEP_NODELIST", "gpu[07-08,11],cpu3"),
        ])
    };
    let (_, _, c0) = identity_from(&slurm("0", "1")).unwrap();
    let (_, _, c5) = identity_from(&slurm("5", "1")).unwrap();
    let (_, _, other) = identity_from(&slurm("5", "2")).unwrap();
    assert_eq!(c0, c5);
    assert_ne!(c0, other);
    let (host, port) = c0.rsplit_once(':').unwrap();
    assert_eq!(host, "gpu07");
    assert!(
        (20000..30000).contains(&port.parse::<u32>().unwrap()),
        "{port}"
    );
    assert_eq!(discovery_from(&slurm("5", "1"), &c5, 8), Discovery::Slurm);
    // Rank 0 elsewhere than the first node: an error naming both, at once.
    let with = |rank: &str, extra: (&'static str, &'static str)| {
        let t = slurm(rank, "1");
        identity_from(&move |k: &str| {
            if k == extra.0 {
                Some(extra.1.into())
            } else {
                t(k)
            }
        })
    };
    let e = with("0", ("SLURMD_NODENAME", "cpu3"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cpu3") && e.contains("gpu07") && e.contains("MASTER_ADDR"),
        "{e}"
    );
    assert!(with("0", ("SLURMD_NODENAME", "gpu07.cluster")).is_ok());
    assert!(with("5", ("SLURMD_NODENAME", "cpu3")).is_ok());
    let e = with("5", ("SLURM_DISTRIBUTION", "arbitrary"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("arbitrary") && e.contains("MASTER_ADDR"), "{e}");
    assert!(with("5", ("SLURM_DISTRIBUTION", "cyclic")).is_ok());
    // MASTER_PORT picks the port; MASTER_ADDR makes it an address as given.
    let mut vars = vec![
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_ID", "9"),
        ("SLURM_JOB_NODELIST", "n1"),
        ("MASTER_PORT", "6000"),
    ];
    assert_eq!(identity_from(&table(&vars)).unwrap().2, "n1:6000");
    vars.push(("MASTER_ADDR", "head"));
    let given = table(&vars);
    let (_, n, c) = identity_from(&given).unwrap();
    assert_eq!(c, "head:6000");
    assert_eq!(discovery_from(&given, &c, n), Discovery::Given);
    // Neither: the error says what to set.
    let bare = table(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]);
    let e = identity_from(&bare).unwrap_err().to_string();
    assert!(
        e.contains("no PMIx or Slurm") && e.contains("MASTER_ADDR"),
        "{e}"
    );
}

#[test]
fn slurm_host_lists() {
    assert_eq!(first_host("node[01-04,07]").as_deref(), Some("node01"));
    assert_eq!(first_host("a1,a2").as_deref(), Some("a1"));
    assert_eq!(first_host("solo").as_deref(), Some("solo"));
    assert_eq!(first_host("n[3,1-2]x").as_deref(), Some("n3x"));
    assert_eq!(
        first_host("rack[2-3]-n[05-06],z").as_deref(),
        Some("rack2-n05")
    );
    assert_eq!(first_host(" ").as_deref(), None);
    assert_eq!(first_host("n[]").as_deref(), None);
}

#[test]
fn each_launchers_variables_on_their_own() {
    let slurm = table(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_JOB_ID", "4711"),
        ("SLURM_STEP_ID", "2"),
        ("SLURM_JOB_NUM_NODES", "2"),
        ("MASTER_ADDR", "node17"),
    ]);
    assert_eq!(
        identity_from(&slurm).unwrap(),
        (3, 8, "node17:29500".to_string())
    );
    assert_eq!(job_id_from(&slurm), "slurm:4711.2");
    assert_eq!(local_world_from(&slurm, 8).unwrap(), None, "two nodes");
    let one_node = table(&[("SLURM_JOB_NUM_NODES", "1")]);
    assert_eq!(local_world_from(&one_node, 8).unwrap(), Some(8));
    let ompi = table(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("PMIX_NAMESPACE", "prterun-x-1@1"),
        ("RDMACOMM_COORDINATOR", "10.0.0.1:5000"),
    ]);
    assert_eq!(
        identity_from(&ompi).unwrap(),
        (1, 4, "10.0.0.1:5000".to_string())
    );
    assert_eq!(job_id_from(&ompi), "pmix:prterun-x-1@1");
    assert_eq!(local_world_from(&ompi, 4).unwrap(), Some(2));
    let pmi = table(&[("PMI_RANK", "0"), ("PMI_SIZE", "2"), ("MASTER_ADDR", "::1")]);
    assert_eq!(
        identity_from(&pmi).unwrap(),
        (0, 2, "[::1]:29500".to_string())
    );
    // torchrun's variables come before the MPI ones; rdmacomm's before all.
    let both = table(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "3"),
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "9"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "7"),
        ("TORCHELASTIC_RUN_ID", "run5"),
    ]);
    assert_eq!(identity_from(&both).unwrap(), (2, 3, "h:7".to_string()));
    assert_eq!(job_id_from(&both), "torchelastic:run5");
    let own = table(&[
        ("RDMACOMM_RANK", "1"),
        ("RDMACOMM_WORLD_SIZE", "2"),
        ("RANK", "0"),
        ("WORLD_SIZE", "5"),
        ("MASTER_ADDR", "h"),
    ]);
    assert_eq!(identity_from(&own).unwrap().0, 1);
    // Half a pair, or no coordinator for a world of several, is named.
    let half = table(&[("SLURM_PROCID", "1")]);
    let e = identity_from(&half).unwrap_err().to_string();
    assert!(
        e.contains("SLURM_PROCID is set but SLURM_NTASKS is not"),
        "{e}"
    );
    let lost = table(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")]);
    let e = identity_from(&lost).unwrap_err().to_string();
    assert!(e.contains("no coordinator address"), "{e}");
    assert_eq!(identity_from(&table(&[])).unwrap(), (0, 1, String::new()));
    // A nuvec (MLX ring) launch: MLX_RANK and its hostfile; rank 0's address is where we meet.
    let dir = std::env::temp_dir().join(format!("rdmacomm-hostfile-{}", std::process::id()));
    std::fs::write(&dir, r#"[["127.0.0.1:5000"],["127.0.0.1:5001"],["h:2"]]"#).unwrap();
    let path = dir.to_string_lossy().into_owned();
    let mlx = table(&[("MLX_RANK", "1"), ("MLX_HOSTFILE", path.as_str())]);
    assert_eq!(
        identity_from(&mlx).unwrap(),
        (1, 3, "127.0.0.1:5000".to_string())
    );
    let given = table(&[
        ("MLX_RANK", "2"),
        ("MLX_HOSTFILE", path.as_str()),
        ("MASTER_ADDR", "m"),
    ]);
    assert_eq!(
        identity_from(&given).unwrap(),
        (2, 3, "m:29500".to_string())
    );
    std::fs::remove_file(&dir).unwrap();
    let e = identity_from(&mlx).unwrap_err().to_string();
    assert!(e.contains("MLX_HOSTFILE="), "{e}");
    let e = identity_from(&table(&[("MLX_RANK", "0")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("MLX_HOSTFILE is not"), "{e}");
    // Timeouts out of range are named, never a panic converting them.
    for bad in ["1e20", "1e-10", "0", "-1", "inf", "NaN"] {
        let e = timeout_of("RDMACOMM_TIMEOUT", bad).unwrap_err().to_string();
        assert!(e.contains("RDMACOMM_TIMEOUT"), "{bad}: {e}");
    }
    assert_eq!(
        timeout_of("NUVEC_DISTRIBUTED_TIMEOUT", "2.5").unwrap(),
        Duration::from_millis(2500)
    );
    // The local rank a device list spreads by.
    assert_eq!(
        local_rank_from(&table(&[("SLURM_LOCALID", "3")])).unwrap(),
        3
    );
    let torch_and_mpi = table(&[("LOCAL_RANK", "1"), ("OMPI_COMM_WORLD_LOCAL_RANK", "5")]);
    assert_eq!(local_rank_from(&torch_and_mpi).unwrap(), 1);
    assert_eq!(local_rank_from(&table(&[])).unwrap(), 0);
    assert!(local_rank_from(&table(&[("MPI_LOCALRANKID", "x")])).is_err());
}

#[test]
fn default_slot_sizes_fit_the_budget() {
    for (n, want) in [(1, 1 << 20), (2, 2 << 20), (4, 1 << 20), (8, 512 << 10)] {
        assert_eq!(default_slot_bytes(n, DEFAULT_SLOTS), want, "{n} ranks");
    }
    assert_eq!(
        default_slot_bytes(6, DEFAULT_SLOTS),
        512 << 10,
        "rounds down"
    );
    assert_eq!(default_slot_bytes(64, DEFAULT_SLOTS), 64 << 10);
    assert_eq!(default_slot_bytes(256, DEFAULT_SLOTS), 16 << 10);
    assert_eq!(default_slot_bytes(1024, DEFAULT_SLOTS), 4 << 10);
    assert_eq!(default_slot_bytes(4096, DEFAULT_SLOTS), 4 << 10, "floor");
    assert_eq!(default_slot_bytes(3, DEFAULT_SLOTS), 1 << 20);
    for n in 1..=2048 {
        let b = default_slot_bytes(n, DEFAULT_SLOTS);
        let cap = if n == 2 { 2 << 20 } else { 1 << 20 };
        assert!(b.is_power_of_two() && (MIN_DEFAULT_SLOT..=cap).contains(&b));
        // Pinned slots stay within the budget up to 1024 ranks, and twice it up to 2048.
        let budget = if n <= 1024 {
            SLOT_BUDGET
        } else {
            2 * SLOT_BUDGET
        };
        assert!(2 * n * DEFAULT_SLOTS * b <= budget, "{n}");
    }
}
