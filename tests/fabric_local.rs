//! The libfabric layer inside one process: two endpoints on one provider exchange RMA writes with
//! immediate data and control messages. Providers come from `FEP_TEST_PROVIDERS` (comma list) or
//! default to shm, tcp;ofi_rxm and udp;ofi_rxd.

use std::time::Duration;

use fabric_ep::fabric::{Completion, InfoQuery, MemKind, Stack};
use fabric_ep::util::Deadline;

/// Reads completions until `pred` has accepted `n` of them, bounded by a deadline.
mod common;

fn drain(stack: &Stack, n: usize, mut pred: impl FnMut(&Completion) -> bool) -> Vec<Completion> {
    let deadline = Deadline::after(Duration::from_secs(10));
    let mut got = Vec::new();
    let mut buf = [Completion { context: 0, flags: 0, len: 0, data: 0 }; 16];
    while got.len() < n {
        let k = stack.cq.read(&mut buf).expect("cq read");
        got.extend(buf[..k].iter().filter(|c| pred(c)).copied());
        assert!(!deadline.expired(), "timed out with {} of {n} completions", got.len());
    }
    got
}

#[test]
fn write_with_immediate_between_two_endpoints() {
    for prov in common::providers(common::ALL_PROVIDERS) {
        let a =
            Stack::open(&InfoQuery::provider(&prov), 2).unwrap_or_else(|e| panic!("{prov}: {e}"));
        let b = Stack::open(&InfoQuery::provider(&prov), 2).unwrap();
        let addrs_a = a.connect(&[a.ep.name().unwrap(), b.ep.name().unwrap()]).unwrap();
        b.connect(&[a.ep.name().unwrap(), b.ep.name().unwrap()]).unwrap();

        const LEN: usize = 3 << 20;
        let mut src: Vec<u8> = (0..LEN).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; LEN];
        let smr = unsafe { a.register(src.as_mut_ptr(), LEN, MemKind::Host).unwrap() };
        let dmr = unsafe { b.register(dst.as_mut_ptr(), LEN, MemKind::Host).unwrap() };
        let remote = dmr.remote();
        let dl = Deadline::after(Duration::from_secs(10));
        // The receiver must drive its own progress (shm and tcp need the peer to progress to
        // accept the connection), so it drains on its own thread while `a` posts.
        let remote_c = std::thread::scope(|s| {
            let rx = s.spawn(|| drain(&b, 3, |c| c.has_data()));
            // Three writes of different sizes, one empty message carrying only its immediate.
            let plan = [(0usize, 1usize << 20, 11u64), (1 << 20, 2 << 20, 22), (0, 0, 33)];
            for (i, &(off, len, imm)) in plan.iter().enumerate() {
                unsafe {
                    a.ep.write(
                        &smr,
                        off,
                        len,
                        addrs_a[1],
                        &remote,
                        off as u64,
                        Some(imm),
                        i as u64 + 1,
                        dl,
                    )
                    .unwrap_or_else(|e| panic!("{prov}: {e}"));
                }
            }
            let local = drain(&a, 3, |c| c.is_local_tx());
            let mut ctx: Vec<u64> = local.iter().map(|c| c.context).collect();
            ctx.sort();
            assert_eq!(ctx, vec![1, 2, 3], "{prov}: local completions");
            rx.join().unwrap()
        });
        let mut imms: Vec<u64> = remote_c.iter().map(|c| c.data).collect();
        imms.sort();
        assert_eq!(imms, vec![11, 22, 33], "{prov}: immediates");
        assert!(dst == src, "{prov}: payload differs");
        drop((smr, dmr));
    }
}

#[test]
fn bad_arguments_are_typed_errors() {
    let a = Stack::open(&InfoQuery::provider("shm"), 1).unwrap();
    let addrs = a.connect(&[a.ep.name().unwrap()]).unwrap();
    let mut buf = vec![0u8; 4096];
    let mr = unsafe { a.register(buf.as_mut_ptr(), buf.len(), MemKind::Host).unwrap() };
    let remote = mr.remote();
    let dl = Deadline::after(Duration::from_secs(1));
    let e =
        unsafe { a.ep.write(&mr, 4000, 200, addrs[0], &remote, 0, Some(1), 0, dl) }.unwrap_err();
    assert!(e.to_string().contains("local_offset"), "{e}");
    let e =
        unsafe { a.ep.write(&mr, 0, 200, addrs[0], &remote, 4000, Some(1), 0, dl) }.unwrap_err();
    assert!(e.to_string().contains("remote_offset"), "{e}");
    let e =
        Stack::open(&InfoQuery::provider("no-such-provider"), 1).err().expect("unknown provider");
    assert!(e.to_string().contains("no-such-provider"), "{e}");
    let e = unsafe { a.register(std::ptr::null_mut(), 0, MemKind::Host) }.err().unwrap();
    assert!(e.to_string().contains("len"), "{e}");
}

#[test]
fn several_endpoints_per_domain_and_several_domains() {
    use fabric_ep::fabric::{find, AddressVector, CompletionQueue, Domain, Endpoint, Fabric};
    // Two endpoints on ONE domain (one CQ/AV each), plus a second domain opened from the same
    // entry (one domain per NIC is the same call with another fi_info entry).
    let info = find(&InfoQuery::provider("shm")).unwrap().remove(0);
    let fabric = Fabric::open(&info).unwrap();
    let dom = Domain::open(&fabric, &info).unwrap();
    let dom2 = Domain::open(&fabric, &info).unwrap();
    let open = |d: &std::sync::Arc<Domain>| {
        let cq = CompletionQueue::open(d, 0).unwrap();
        let av = AddressVector::open(d, 4).unwrap();
        Endpoint::open(d, &cq, &av).unwrap()
    };
    let (e1, e2, e3) = (open(&dom), open(&dom), open(&dom2));
    let names = [e1.name().unwrap(), e2.name().unwrap(), e3.name().unwrap()];
    assert!(names[0] != names[1] && names[1] != names[2], "distinct endpoint addresses");
    let addrs: Vec<_> = names.iter().map(|n| e1.av().insert(n).unwrap()).collect();
    for ep in [&e2, &e3] {
        for n in &names {
            ep.av().insert(n).unwrap();
        }
    }
    let mut src = vec![7u8; 4096];
    let mut dst2 = vec![0u8; 4096];
    let mut dst3 = vec![0u8; 4096];
    let smr = unsafe { register_on(&dom, &e1, &mut src) };
    let r2 = unsafe { register_on(&dom, &e2, &mut dst2) };
    let r3 = unsafe { register_on(&dom2, &e3, &mut dst3) };
    let dl = Deadline::after(Duration::from_secs(10));
    std::thread::scope(|s| {
        for (ep, want) in [(&e2, 5u64), (&e3, 6u64)] {
            s.spawn(move || {
                let mut buf = [Completion { context: 0, flags: 0, len: 0, data: 0 }; 4];
                loop {
                    let n = ep.cq().read(&mut buf).unwrap();
                    if let Some(c) = buf[..n].iter().find(|c| c.has_data()) {
                        assert_eq!(c.data, want);
                        return;
                    }
                    assert!(!dl.expired(), "no arrival with immediate {want}");
                }
            });
        }
        unsafe {
            e1.write(&smr, 0, 4096, addrs[1], &r2.remote(), 0, Some(5), 1, dl).unwrap();
            e1.write(&smr, 0, 4096, addrs[2], &r3.remote(), 0, Some(6), 2, dl).unwrap();
        }
        let mut buf = [Completion { context: 0, flags: 0, len: 0, data: 0 }; 4];
        let mut done = 0;
        while done < 2 {
            done += e1.cq().read(&mut buf).unwrap();
            assert!(!dl.expired());
        }
    });
    assert!(dst2.iter().chain(&dst3).all(|&b| b == 7));
    drop((smr, r2, r3));
}

/// Registers a vector with a domain, binding to `ep` where the provider asks for it.
unsafe fn register_on(
    d: &std::sync::Arc<fabric_ep::fabric::Domain>,
    ep: &std::sync::Arc<fabric_ep::fabric::Endpoint>,
    v: &mut [u8],
) -> fabric_ep::fabric::MemoryRegion {
    fabric_ep::fabric::MemoryRegion::register(d, Some(ep), v.as_mut_ptr(), v.len(), MemKind::Host)
        .unwrap()
}
