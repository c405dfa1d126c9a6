//! GPU: the CUDA layer itself (buffers, mapped host memory, events, IPC between processes).
//! Ignored without `--include-ignored`; scripts/gpu-check.sh runs them.

mod common;
use common::gpu::gpu;
use fabric_ep::cuda::{DeviceBuffer, Event, HostMapped, IpcHandle, IpcMapping, PeerMemory, Stream};
use std::sync::Arc;
use std::time::Duration;

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_device_buffers_round_trip_and_events_time() {
    let Some(dev) = gpu() else { return };
    eprintln!("{dev:?} cc {:?} mem {:?}", dev.compute_capability(), dev.mem_info().unwrap());
    assert!(dev.sm_count() > 0);
    let data: Vec<u32> = (0..1_000_000u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let a = DeviceBuffer::from_slice(&dev, &data).unwrap();
    let mut b = DeviceBuffer::new(&dev, a.len()).unwrap();
    let stream = Stream::new(&dev).unwrap();
    let (e0, e1) = (Event::new(&dev).unwrap(), Event::new(&dev).unwrap());
    e0.record(&stream).unwrap();
    b.memset_async(0xAB, &stream).unwrap();
    e1.record(&stream).unwrap();
    stream.synchronize_within(Duration::from_secs(10)).unwrap();
    let ms = e0.elapsed_ms(&e1).unwrap();
    assert!((0.0..1000.0).contains(&ms), "{ms} ms");
    assert!(b.to_vec::<u8>().unwrap().iter().all(|&x| x == 0xAB));
    b.copy_from_device(&a).unwrap();
    assert_eq!(b.to_vec::<u32>().unwrap(), data);
    assert!(DeviceBuffer::new(&dev, 0).unwrap().to_vec::<u8>().unwrap().is_empty());
    let mut wrong = vec![0u32; 3];
    assert!(b.copy_to_host(&mut wrong).is_err(), "length mismatch is an error");
}

/// A kept stream (a buffer's comm stream) outlives its owner: still usable (an event recorded
/// on it, as torch's allocator does when a tensor recorded on it is freed) after the owner is
/// dropped, and handed to the next kept stream of the device instead of a new one.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_kept_stream_outlives_its_owner_and_is_reused() {
    let Some(dev) = gpu() else { return };
    let a = Stream::kept(&dev).unwrap();
    let b = Stream::kept(&dev).unwrap();
    assert_ne!(a.as_raw(), b.as_raw(), "two live kept streams are distinct");
    let raw = a.as_raw();
    drop(a);
    // SAFETY: a kept stream is never destroyed; `raw` is valid for the process.
    let after = unsafe { Stream::borrowed(&dev, raw) };
    let e = Event::new_untimed(&dev).unwrap();
    e.record(&after).unwrap();
    after.synchronize_within(Duration::from_secs(10)).unwrap();
    assert!(after.query().unwrap());
    let c = Stream::kept(&dev).unwrap();
    assert_eq!(c.as_raw(), raw, "the given-back stream is reused");
    drop((b, c));
}

/// Mapped host memory: the GPU's view (device pointer) and the CPU's view are the same bytes.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_host_mapped_is_shared_with_the_device() {
    let Some(dev) = gpu() else { return };
    let m = HostMapped::new(&dev, 4096).unwrap();
    for i in 0..512 {
        m.write::<u64>(i * 8, i as u64 * 3 + 1).unwrap();
    }
    // Device-to-device copy reading through the mapped device pointer.
    let d = DeviceBuffer::new(&dev, 4096).unwrap();
    dev.bind().unwrap();
    // SAFETY: both ranges are 4096 bytes.
    let r = unsafe { cudarc::driver::sys::cuMemcpyDtoD_v2(d.device_ptr(), m.device_ptr(), 4096) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    let got: Vec<u64> = d.to_vec().unwrap();
    assert!(got.iter().enumerate().all(|(i, &v)| v == i as u64 * 3 + 1));
    // And the GPU writing into it.
    d.memset(0x5A).unwrap();
    // SAFETY: as above.
    let r = unsafe { cudarc::driver::sys::cuMemcpyDtoD_v2(m.device_ptr(), d.device_ptr(), 4096) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    assert!(m.snapshot().iter().all(|&b| b == 0x5A));
    assert!(
        m.read::<u64>(4090).is_err() && m.read::<u64>(3).is_err(),
        "range and alignment checked"
    );
}

/// CUDA IPC between two processes sharing the GPU: the test re-runs itself as the child (env
/// FEP_IPC_CHILD), which opens the parent's buffer, checks the parent's pattern and writes its own.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_ipc_between_processes() {
    let Some(dev) = gpu() else { return };
    const LEN: usize = 1 << 20;
    if let Ok(hex) = std::env::var("FEP_IPC_CHILD") {
        let h = IpcHandle::from_hex(&hex).unwrap();
        let m = IpcMapping::open(&dev, &h, LEN).unwrap();
        let peer = PeerMemory::Ipc(m);
        assert_ne!(peer.device_ptr(), 0);
        let PeerMemory::Ipc(m) = &peer else { unreachable!() };
        let mut buf = vec![0u8; LEN];
        m.copy_to_host(&mut buf).unwrap();
        assert!(buf.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "parent's pattern");
        let mine: Vec<u8> = (0..LEN).map(|i| (i % 241) as u8 ^ 0xFF).collect();
        m.copy_from_host(&mine).unwrap();
        eprintln!("child: read the parent's pattern, wrote mine");
        return;
    }
    let pattern: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    let buf = DeviceBuffer::from_slice(&dev, &pattern).unwrap();
    let h = buf.ipc_handle().unwrap();
    // Opening one's own handle is refused by CUDA: same-process peers use direct pointers.
    assert!(IpcMapping::open(&dev, &h, LEN).is_err(), "same-process IPC open must fail");
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--exact", "gpu_ipc_between_processes", "--include-ignored", "--nocapture"])
        .env("FEP_IPC_CHILD", h.to_hex())
        .output()
        .unwrap();
    let log =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {log}");
    assert!(log.contains("1 passed"), "child ran the test: {log}");
    let want: Vec<u8> = (0..LEN).map(|i| (i % 241) as u8 ^ 0xFF).collect();
    assert_eq!(buf.to_vec::<u8>().unwrap(), want, "the child's writes are visible here");
    // Same-process peer: the direct pointer.
    let shared = Arc::new(buf);
    let peer = PeerMemory::direct(&dev, shared.clone()).unwrap();
    assert_eq!(peer.device_ptr(), shared.device_ptr());
    assert_eq!(peer.len(), LEN);
}
