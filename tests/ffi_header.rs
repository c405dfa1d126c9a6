//! The committed C header must equal what cbindgen generates from src/ffi today.
//! Regenerate with `FEP_BLESS=1 cargo test --test ffi_header`.

use std::path::Path;

#[test]
fn header_is_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cfg = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_config(cfg)
        .with_src(root.join("src/ffi/mod.rs"))
        .generate()
        .expect("cbindgen")
        .write(&mut out);
    let generated = String::from_utf8(out).expect("utf-8");
    let path = root.join("ffi/include/fabric_ep.h");
    if std::env::var_os("FEP_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write header");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "ffi/include/fabric_ep.h is stale: run `FEP_BLESS=1 cargo test --test ffi_header` and commit it"
    );
}
