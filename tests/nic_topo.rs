//! NIC selection against fake sysfs trees of AWS shapes (P5: 8 GPUs and 32 EFA, 4 behind each
//! GPU's PCIe switch, 2 sockets; P5en: 2 per GPU; one NIC), and against the providers of this
//! machine (one domain per fabric: the choice is libfabric's first entry, as before).

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use fabric_ep::fabric::topo::{
    choose, nearest, normalize_bdf, rank_nics, NicCandidate, NicsOverride, Placement, Proximity,
    Sysfs,
};
use fabric_ep::fabric::{find, find_first, select_with, FabricError, InfoQuery};

/// A fake sysfs root, removed on drop.
struct FakeSys {
    root: PathBuf,
    gpus: Vec<String>,
    /// Per switch, its NICs' domain names.
    nics: Vec<Vec<String>>,
}

impl Drop for FakeSys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// The shape of a fake host.
struct Shape {
    switches: usize,
    sockets: usize,
    nics_per_switch: usize,
    /// Switches whose NICs are absent (their GPU has none of its own).
    without_nics: Vec<usize>,
    /// Switches per root complex (1: each switch under its own `pci0000:xx`).
    switches_per_root: usize,
}

fn p5() -> Shape {
    Shape {
        switches: 8,
        sockets: 2,
        nics_per_switch: 4,
        without_nics: vec![],
        switches_per_root: 1,
    }
}

fn mkdev(dir: &Path, numa: usize) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
}

/// Switch `s`: host bridge `pci0000:{hb}`, root port, switch upstream port, one downstream port
/// per device; the GPU on the first, NIC `j` on port `j + 1`. NUMA node `s / (switches /
/// sockets)`. NICs appear as `class/infiniband/rdmap{bus}s0/device`.
fn build(name: &str, shape: &Shape) -> FakeSys {
    let root = std::env::temp_dir().join(format!("fep-sysfs-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (devices, bus_pci, ib) =
        (root.join("devices"), root.join("bus/pci/devices"), root.join("class/infiniband"));
    for d in [&devices, &bus_pci, &ib] {
        std::fs::create_dir_all(d).unwrap();
    }
    let per_socket = shape.switches / shape.sockets;
    let (mut gpus, mut nics) = (Vec::new(), Vec::new());
    for s in 0..shape.switches {
        let numa = s / per_socket;
        let rc = s / shape.switches_per_root;
        let hb = 0x10 * shape.switches_per_root * rc;
        // Buses: each switch gets 16 of its root complex's.
        let base = hb + 0x10 * (s % shape.switches_per_root) + 1;
        let host = devices.join(format!("pci0000:{hb:02x}"));
        let rp = host.join(format!("0000:{hb:02x}:{:02x}.0", 1 + s % shape.switches_per_root));
        let up = rp.join(format!("0000:{base:02x}:00.0"));
        for dir in [&rp, &up] {
            mkdev(dir, numa);
        }
        let put = |port: usize, bus: usize| -> (String, PathBuf) {
            let down = up.join(format!("0000:{:02x}:{port:02x}.0", base + 1));
            mkdev(&down, numa);
            let bdf = format!("0000:{bus:02x}:00.0");
            let dev = down.join(&bdf);
            mkdev(&dev, numa);
            symlink(&dev, bus_pci.join(&bdf)).unwrap();
            (bdf, dev)
        };
        let (gpu, _) = put(0, base + 2);
        gpus.push(gpu);
        let mut mine = Vec::new();
        if !shape.without_nics.contains(&s) {
            for j in 0..shape.nics_per_switch {
                let bus = base + 3 + j;
                let (_, dev) = put(j + 1, bus);
                let ibdev = format!("rdmap{bus}s0");
                std::fs::create_dir_all(ib.join(&ibdev)).unwrap();
                symlink(&dev, ib.join(&ibdev).join("device")).unwrap();
                mine.push(format!("{ibdev}-rdm"));
            }
        }
        nics.push(mine);
    }
    FakeSys { root, gpus, nics }
}

impl FakeSys {
    fn sysfs(&self) -> Sysfs {
        Sysfs::new(&self.root)
    }
    /// Every NIC as libfabric would list it: sorted by name (not by switch), no bus address.
    fn candidates(&self) -> Vec<NicCandidate> {
        let mut all: Vec<String> = self.nics.iter().flatten().cloned().collect();
        all.sort();
        all.into_iter().map(|domain| NicCandidate { domain, pci: None }).collect()
    }
}

fn placement(gpu: Option<&str>, local_rank: usize, lane: usize, lanes: usize) -> Placement {
    Placement { rank: Some(local_rank), local_rank, gpu_pci: gpu.map(str::to_string), lane, lanes }
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[test]
fn p5_each_gpu_gets_its_four_switch_local_nics_in_a_stable_order() {
    let fake = build("p5", &p5());
    let (sys, cands) = (fake.sysfs(), fake.candidates());
    assert_eq!(cands.len(), 32);
    let mut seen = Vec::new();
    for (g, gpu) in fake.gpus.iter().enumerate() {
        let ranked = rank_nics(&sys, Some(gpu), &cands);
        assert_eq!(ranked.len(), 32);
        let near = nearest(&ranked);
        let names: Vec<String> = near.iter().map(|n| n.domain.clone()).collect();
        assert_eq!(sorted(names.clone()), sorted(fake.nics[g].clone()), "GPU {g}");
        assert!(near.iter().all(|n| n.proximity == Proximity::SameSwitch));
        // Ties keep libfabric's order; the next tier is the same socket's other NICs.
        let idx: Vec<usize> = near.iter().map(|n| n.index).collect();
        assert!(idx.windows(2).all(|w| w[0] < w[1]), "{idx:?}");
        assert_eq!(ranked[4].proximity, Proximity::SameNuma, "GPU {g}: {:?}", ranked[4]);
        assert_eq!(ranked[31].proximity, Proximity::Far);
        assert_eq!(ranked, rank_nics(&sys, Some(gpu), &cands), "ranking must be repeatable");
        // Four proxy workers: one NIC each, all four used.
        let mut used = Vec::new();
        for w in 0..4 {
            let c =
                choose(&sys, &NicsOverride::Auto, &placement(Some(gpu), g, w, 4), &cands).unwrap();
            assert!(!c.overridden);
            assert_eq!(c.set.len(), 4);
            used.push(c.chosen.domain.clone());
        }
        assert_eq!(sorted(used.clone()), sorted(fake.nics[g].clone()), "GPU {g}");
        seen.extend(used);
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 32, "every NIC of the host carries one GPU's worker");
}

#[test]
fn nvidia_style_bus_ids_and_case_are_accepted() {
    assert_eq!(normalize_bdf("00000000:53:00.0").as_deref(), Some("0000:53:00.0"));
    assert_eq!(normalize_bdf("0000:9A:1F.7").as_deref(), Some("0000:9a:1f.7"));
    assert_eq!(normalize_bdf("53:00.0").as_deref(), Some("0000:53:00.0"));
    for bad in ["", "rdmap16s27", "0000:53:00", "0000:53:20.0", "0000:153:00.0", "x:y:z.w"] {
        assert_eq!(normalize_bdf(bad), None, "{bad:?}");
    }
    let fake = build("bdf", &p5());
    let sys = fake.sysfs();
    let gpu = fake.gpus[2].clone();
    let upper = format!("0000{}", gpu.to_uppercase());
    let a = nearest(&rank_nics(&sys, Some(&gpu), &fake.candidates()));
    let b = nearest(&rank_nics(&sys, Some(&upper), &fake.candidates()));
    assert_eq!(a, b);
    assert_eq!(a.len(), 4);
}

#[test]
fn a_gpu_without_a_switch_local_nic_falls_back_to_its_numa_node() {
    let fake = build("p5-hole", &Shape { without_nics: vec![3], ..p5() });
    let (sys, cands) = (fake.sysfs(), fake.candidates());
    assert_eq!(cands.len(), 28);
    let near = nearest(&rank_nics(&sys, Some(&fake.gpus[3]), &cands));
    let want: Vec<String> = fake.nics[..3].iter().flatten().cloned().collect();
    assert_eq!(sorted(near.iter().map(|n| n.domain.clone()).collect()), sorted(want));
    assert!(near.iter().all(|n| n.proximity == Proximity::SameNuma));
    // The other GPUs are unaffected.
    let near0 = nearest(&rank_nics(&sys, Some(&fake.gpus[0]), &cands));
    assert_eq!(near0.len(), 4);
}

#[test]
fn a_shared_root_complex_beats_the_numa_node() {
    // Two switches per root complex: GPU 1's switch has no NIC, switch 0 (same root) does.
    let shape = Shape { without_nics: vec![1], switches_per_root: 2, ..p5() };
    let fake = build("p5-rc", &shape);
    let near = nearest(&rank_nics(&fake.sysfs(), Some(&fake.gpus[1]), &fake.candidates()));
    assert_eq!(
        sorted(near.iter().map(|n| n.domain.clone()).collect()),
        sorted(fake.nics[0].clone())
    );
    assert!(near.iter().all(|n| n.proximity == Proximity::SameRootComplex));
}

#[test]
fn p5en_two_nics_per_gpu_shard_over_workers() {
    let fake = build("p5en", &Shape { nics_per_switch: 2, ..p5() });
    let (sys, cands) = (fake.sysfs(), fake.candidates());
    assert_eq!(cands.len(), 16);
    for (g, gpu) in fake.gpus.iter().enumerate() {
        let got: Vec<String> = (0..4)
            .map(|w| {
                choose(&sys, &NicsOverride::Auto, &placement(Some(gpu), g, w, 4), &cands)
                    .unwrap()
                    .chosen
                    .domain
            })
            .collect();
        // Four workers over two NICs: each NIC twice, alternating.
        assert_eq!(got[0], got[2]);
        assert_eq!(got[1], got[3]);
        assert_ne!(got[0], got[1]);
        assert_eq!(sorted(got[..2].to_vec()), sorted(fake.nics[g].clone()));
    }
}

#[test]
fn one_nic_host_uses_it_for_everyone() {
    let shape = Shape {
        switches: 2,
        sockets: 2,
        nics_per_switch: 1,
        without_nics: vec![1],
        switches_per_root: 1,
    };
    let fake = build("one", &shape);
    let (sys, cands) = (fake.sysfs(), fake.candidates());
    assert_eq!(cands.len(), 1);
    for (g, gpu) in fake.gpus.iter().enumerate() {
        for w in 0..3 {
            let c =
                choose(&sys, &NicsOverride::Auto, &placement(Some(gpu), g, w, 3), &cands).unwrap();
            assert_eq!(c.chosen.domain, cands[0].domain);
            let want = if g == 0 { Proximity::SameSwitch } else { Proximity::Far };
            assert_eq!(c.chosen.proximity, want);
        }
    }
}

#[test]
fn without_a_gpu_the_node_spreads_over_every_nic_by_local_rank() {
    let fake = build("host", &p5());
    let (sys, cands) = (fake.sysfs(), fake.candidates());
    let mut got = Vec::new();
    for l in 0..8 {
        let c = choose(&sys, &NicsOverride::Auto, &placement(None, l, 0, 1), &cands).unwrap();
        assert_eq!(c.set.len(), 32);
        assert_eq!(c.chosen.proximity, Proximity::Unknown);
        got.push(c.index);
    }
    assert_eq!(got, (0..8).collect::<Vec<_>>());
    // The default placement (one endpoint, local rank 0) is libfabric's first entry.
    let c = choose(&sys, &NicsOverride::Auto, &Placement::default(), &cands).unwrap();
    assert_eq!(c.index, 0);
}

#[test]
fn provider_bus_address_is_used_before_the_domain_name() {
    let fake = build("busattr", &p5());
    let sys = fake.sysfs();
    // Names sysfs does not know, addresses it does: the GPU 5 switch's NICs by address.
    let bdfs: Vec<String> = fake.nics[5]
        .iter()
        .map(|n| {
            let dev = n.trim_end_matches("-rdm");
            let link = fake.root.join("class/infiniband").join(dev).join("device");
            std::fs::canonicalize(link).unwrap().file_name().unwrap().to_string_lossy().into()
        })
        .collect();
    let mut cands: Vec<NicCandidate> = (0..4)
        .map(|i| NicCandidate { domain: format!("nic{i}"), pci: Some(bdfs[i].clone()) })
        .collect();
    cands.insert(0, NicCandidate { domain: "unknown0".into(), pci: None });
    let near = nearest(&rank_nics(&sys, Some(&fake.gpus[5]), &cands));
    let names: Vec<&str> = near.iter().map(|n| n.domain.as_str()).collect();
    assert_eq!(names, ["nic0", "nic1", "nic2", "nic3"]);
    // A GPU elsewhere still prefers them to the NIC of unknown place.
    let r = rank_nics(&sys, Some(&fake.gpus[0]), &cands);
    assert_eq!(r.last().unwrap().domain, "unknown0");
}

#[test]
fn fep_nics_syntax() {
    assert_eq!(NicsOverride::parse(None).unwrap(), NicsOverride::Auto);
    assert_eq!(NicsOverride::parse(Some(" auto ")).unwrap(), NicsOverride::Auto);
    assert_eq!(
        NicsOverride::parse(Some("a-rdm, b")).unwrap(),
        NicsOverride::All(vec!["a-rdm".into(), "b".into()])
    );
    assert_eq!(
        NicsOverride::parse(Some("0:a,b;1:auto; 3:c")).unwrap(),
        NicsOverride::PerRank(vec![
            (0, Some(vec!["a".into(), "b".into()])),
            (1, None),
            (3, Some(vec!["c".into()])),
        ])
    );
    for bad in ["a,,b", "x:a", "0:a;0:b", "0:a;b", "0:"] {
        let e = NicsOverride::parse(Some(bad)).expect_err(bad).to_string();
        assert!(e.contains("FEP_NICS"), "{bad}: {e}");
    }
}

#[test]
fn fep_nics_overrides_and_bad_names_are_refused() {
    let fake = build("override", &p5());
    let (sys, cands) = (fake.sysfs(), fake.candidates());
    let gpu = fake.gpus[0].clone();
    // Far NICs by name (the `-rdm` suffix may be left off), sharded over the list.
    let far = [fake.nics[7][0].trim_end_matches("-rdm").to_string(), fake.nics[6][1].clone()];
    let all = NicsOverride::parse(Some(&far.join(","))).unwrap();
    let got: Vec<String> = (0..2)
        .map(|w| choose(&sys, &all, &placement(Some(&gpu), 0, w, 2), &cands).unwrap().chosen.domain)
        .collect();
    assert_eq!(got, [fake.nics[7][0].clone(), fake.nics[6][1].clone()]);
    let c = choose(&sys, &all, &placement(Some(&gpu), 0, 0, 1), &cands).unwrap();
    assert!(c.overridden);
    // Per local rank: rank 1 gets its own list (unshifted), rank 2 is automatic.
    let spec = format!("0:{};1:{}", fake.nics[3][2], fake.nics[2][0]);
    let per = NicsOverride::parse(Some(&spec)).unwrap();
    let c1 = choose(&sys, &per, &placement(Some(&fake.gpus[1]), 1, 0, 1), &cands).unwrap();
    assert_eq!(c1.chosen.domain, fake.nics[2][0]);
    let c2 = choose(&sys, &per, &placement(Some(&fake.gpus[2]), 2, 0, 1), &cands).unwrap();
    assert!(!c2.overridden);
    assert!(fake.nics[2].contains(&c2.chosen.domain));
    // A name that does not exist: an error naming the variable and the name.
    let bad = NicsOverride::parse(Some(&format!("{},rdmap999s9", fake.nics[0][0]))).unwrap();
    let e = choose(&sys, &bad, &placement(Some(&gpu), 0, 0, 1), &cands).unwrap_err();
    assert!(matches!(e, FabricError::InvalidArgument { arg: "FEP_NICS", .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("rdmap999s9") && msg.contains(&fake.nics[0][0]), "{msg}");
}

#[test]
fn fep_sysfs_root_is_read_from_the_environment() {
    let fake = build("env", &p5());
    // Only this test reads or sets the variable.
    std::env::set_var("FEP_SYSFS_ROOT", &fake.root);
    let sys = Sysfs::from_env();
    std::env::remove_var("FEP_SYSFS_ROOT");
    assert_eq!(sys.root(), fake.root.as_path());
    assert!(sys.place(&fake.gpus[4]).is_some_and(|p| p.numa_node == Some(1)));
    assert_eq!(Sysfs::from_env().root(), Path::new("/sys"));
}

#[test]
fn single_domain_providers_keep_libfabric_first_entry() {
    let sys = Sysfs::new("/sys");
    for prov in ["shm", "tcp", "udp;ofi_rxd"] {
        let q = InfoQuery::provider(prov);
        let Ok(first) = find_first(&q) else {
            eprintln!("skipped {prov}: not installed");
            continue;
        };
        for l in 0..4 {
            for w in 0..3 {
                let p = placement(None, l, w, 3);
                let got = select_with(find(&q).unwrap(), &sys, &NicsOverride::Auto, &p).unwrap();
                assert_eq!(
                    (got.domain_name(), got.fabric_name()),
                    (first.domain_name(), first.fabric_name()),
                    "{prov} local rank {l} endpoint {w}"
                );
            }
        }
        // A name that is no domain of the provider is refused, naming the variable.
        let bad = NicsOverride::All(vec!["no-such-nic0".into()]);
        let e = select_with(find(&q).unwrap(), &sys, &bad, &Placement::default()).unwrap_err();
        assert!(e.to_string().contains("FEP_NICS"), "{e}");
        // The first entry's domain by name: the same choice.
        let named = NicsOverride::All(vec![first.domain_name()]);
        let got = select_with(find(&q).unwrap(), &sys, &named, &Placement::default()).unwrap();
        assert_eq!(got.domain_name(), first.domain_name());
    }
}
