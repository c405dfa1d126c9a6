//! Generates raw bindings to the installed libfabric with bindgen, and compiles bindgen's
//! `wrap_static_fns` shims with cc so the header's static-inline calls are linkable.

use std::env;
use std::path::PathBuf;

const MIN_VERSION: &str = "1.17";

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    let lib = pkg_config::Config::new()
        .atleast_version(MIN_VERSION)
        .probe("libfabric")
        .unwrap_or_else(|e| {
            panic!(
                "libfabric >= {MIN_VERSION} not found through pkg-config ({e}).\n\
                 Install it: `apt-get install libfabric-dev pkg-config` (Debian/Ubuntu), or point \
                 PKG_CONFIG_PATH at the libfabric that AWS's EFA installer puts in /opt/amazon/efa."
            )
        });

    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let shims = out.join("fabric_static_fns");

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("fi_.*")
        .allowlist_type("fi_.*|fid.*")
        .allowlist_var("FI_.*|FID_.*")
        .wrap_static_fns(true)
        .wrap_static_fns_path(&shims)
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &lib.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder.generate().expect(
        "bindgen failed on libfabric's headers; is libclang installed (`apt-get install libclang-dev`)?",
    );
    bindings.write_to_file(out.join("bindings.rs")).expect("write bindings.rs");

    let mut cc = cc::Build::new();
    cc.file(shims.with_extension("c")).include(env::current_dir().unwrap()).warnings(false);
    for path in &lib.include_paths {
        cc.include(path);
    }
    cc.compile("fabric_static_fns");
}
