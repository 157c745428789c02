//! Tests of the shared-memory rings: segments, ring sizes, slots.

use super::*;

#[test]
fn a_segment_is_one_memory_for_its_openers_and_has_no_name() {
    let shm_before = std::fs::read_dir("/dev/shm")
        .map(|d| d.count())
        .unwrap_or(0);
    let len = 2 << 20;
    let file = create_file().unwrap();
    let path = path_of(&file);
    let mut s = Segment::size(file, len).unwrap();
    let other = Segment::open(&path, len).unwrap();
    other.counter(64).store(7, Ordering::Release);
    assert_eq!(s.counter(64).load(Ordering::Acquire), 7, "one memory");
    assert!(
        Segment::open(&path, len / 2).is_err(),
        "a size that differs is refused"
    );
    s.file = None;
    assert!(
        Segment::open(&path, len).is_err(),
        "closed: nobody opens it again"
    );
    // A card naming another file of the right size: refused, by its name or by what it is.
    let plain = std::env::temp_dir().join(format!("rdmacomm-seg-{}", std::process::id()));
    std::fs::write(&plain, vec![0u8; 4096]).unwrap();
    let e = Segment::open(plain.to_str().unwrap(), 4096).err().unwrap();
    assert!(e.contains("not /proc/<pid>/fd/<fd>"), "{e}");
    let held = File::open(&plain).unwrap();
    let e = Segment::open(&path_of(&held), 4096).err().unwrap();
    assert!(e.contains("not an rdmacomm memory file"), "{e}");
    std::fs::remove_file(&plain).unwrap();
    for bad in [
        "/proc/1/fd/",
        "/proc/x/fd/3",
        "/proc/1/fd/3/..",
        "/proc/1/cwd/3",
    ] {
        assert!(!is_fd_path(bad), "{bad}");
    }
    assert_eq!(other.counter(64).load(Ordering::Acquire), 7, "still mapped");
    let shm_after = std::fs::read_dir("/dev/shm")
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(shm_before, shm_after, "nothing named in /dev/shm");
}

#[test]
fn a_host_s_rings_grow_with_its_ranks_not_their_square() {
    let ring = |(s, c): (usize, usize)| COUNTERS + s * (HEAD + c);
    // Up to 7 ranks on a host: the full geometry.
    for peers in 1..=6 {
        assert_eq!(
            fit(SLOTS, CHUNK, peers, 0, RING_BUDGET),
            (SLOTS, CHUNK),
            "{peers} peers"
        );
    }
    for ranks in [2usize, 8, 16, 32, 64, 128] {
        let g = fit(SLOTS, CHUNK, ranks - 1, 0, RING_BUDGET);
        let (s, c) = g;
        assert!(
            s >= MIN_SLOTS && (MIN_CHUNK..=CHUNK).contains(&c),
            "{ranks}: {g:?}"
        );
        // What one rank's segment holds (a ring per rank of the host).
        let segment = ranks * ring(g);
        assert!(segment <= RING_BUDGET, "{ranks} ranks: {segment} bytes");
        if ranks == 64 {
            let host = ranks * segment;
            assert!(
                host <= 256 << 20,
                "64 ranks: {} MiB on the host",
                host >> 20
            );
        }
    }
    // Past 128 ranks, the floor.
    assert_eq!(
        fit(SLOTS, CHUNK, 511, 0, RING_BUDGET),
        (MIN_SLOTS, MIN_CHUNK)
    );
    // Beside a network: untouched while the host holds its rings (two ranks with 1 MiB
    // RDMA chunks: 8 MiB each); never fewer slots than a network peer has (8 here), the
    // chunk halving instead, the host within its budget.
    assert_eq!(fit(4, 1 << 20, 1, 4, HOST_BUDGET / 2), (4, 1 << 20));
    let (s, c) = fit(8, 64 << 10, 63, 8, HOST_BUDGET / 64);
    assert_eq!(s, 8);
    assert!(64 * 64 * ring((s, c)) <= HOST_BUDGET && c < 64 << 10, "{c}");
}

#[test]
fn rings_hold_as_much_whatever_the_chunk() {
    assert_eq!(slots_for(CHUNK), SLOTS);
    assert_eq!(
        slots_for(1 << 20),
        2,
        "two at least: one filled while one is read"
    );
    assert_eq!(slots_for(256 << 10), 2);
    assert_eq!(slots_for(1024), SLOTS, "no more than the default count");
}
