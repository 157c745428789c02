//! Device lists (`RDMACOMM_IB_HCA`, as NCCL_IB_HCA): which device each local rank opens, and a
//! communicator whose two local ranks spread over two devices. Over RDMA only: in the VM, rxe0 and
//! the hosts' rxe_h<i> (tools/rxe-vm --hosts 2 or more); skipped where there is no device.

mod common;
use common::*;
use rdmacomm::unstable::verbs::{self, DeviceChoice, HcaList};
use rdmacomm::{AllReduce, Comm, Communicator, DType};
use std::time::Duration;

/// The device local rank `local` opens under `spec`.
fn opened(spec: &str, local: usize) -> rdmacomm::Result<String> {
    let choice = DeviceChoice {
        hca: Some(HcaList::parse(spec)?),
        local_rank: local,
        ..DeviceChoice::default()
    };
    verbs::open(&choice).map(|(_, sel)| sel.device)
}

#[test]
fn local_ranks_spread_over_the_listed_devices() {
    if !rdma_available() || vm_hosts() < 2 {
        eprintln!("SKIPPED: needs the VM's rxe devices (tools/rxe-vm --hosts 2 or more)");
        return;
    }
    let hosts = vm_hosts();
    for local in 0..2 * hosts {
        assert_eq!(
            opened("rxe_h", local).unwrap(),
            format!("rxe_h{}", local % hosts),
            "prefix list, local rank {local}"
        );
    }
    assert_eq!(
        opened("rxe_h1:1,rxe_h0", 0).unwrap(),
        "rxe_h1",
        "list order"
    );
    assert_eq!(opened("rxe_h1:1,rxe_h0", 1).unwrap(), "rxe_h0");
    for local in 0..3 {
        assert_eq!(opened("^rxe_h", local).unwrap(), "rxe0", "exclusion");
    }
    let e = opened("=rxe_h", 0).unwrap_err().to_string();
    assert!(
        e.contains("allows none of the devices present") && e.contains("rxe0"),
        "{e}"
    );
    let e = opened("rxe_h0:9", 0).unwrap_err().to_string();
    assert!(e.contains("no usable port") || e.contains("port"), "{e}");
}

fn two_nics_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let dev = c.device().unwrap_or_default();
    println!("RESULT rank {r}: ON {dev}");
    let mut d: Vec<u8> = (0..300_000)
        .flat_map(|i| ((r * 7 + i % 101) as f32).to_le_bytes())
        .collect();
    c.all_reduce(AllReduce::Sum, DType::f32, &mut d).unwrap();
    for (i, b) in d.chunks(4).enumerate() {
        let want: f32 = (0..n).map(|q| (q * 7 + i % 101) as f32).sum();
        assert_eq!(
            f32::from_le_bytes(b.try_into().unwrap()),
            want,
            "element {i}"
        );
    }
    println!("RESULT rank {r}: CHECKED");
}

#[test]
fn two_local_ranks_on_two_devices() {
    let name = "two_local_ranks_on_two_devices";
    if !parent_ready(name, two_nics_body) {
        return;
    }
    if !rdma_available() || vm_hosts() < 2 {
        eprintln!("SKIPPED: needs the VM's rxe devices (tools/rxe-vm --hosts 2 or more)");
        return;
    }
    let res = spawn(
        name,
        2,
        Placement::Local,
        &|r| {
            vec![
                ("RDMACOMM_TRANSPORT".into(), "rdma".into()),
                ("RDMACOMM_IB_HCA".into(), "rxe_h0,rxe_h1".into()),
                ("LOCAL_RANK".into(), r.to_string()),
                ("RDMACOMM_TIMEOUT".into(), "30".into()),
            ]
        },
        Duration::from_secs(90),
    );
    assert_all_ok(&res);
    for x in &res {
        let want = format!("RDMA rxe_h{} ", x.rank);
        assert!(
            x.output.contains(&want) && x.output.contains("CHECKED"),
            "rank {}: {}",
            x.rank,
            x.output
        );
    }
}
