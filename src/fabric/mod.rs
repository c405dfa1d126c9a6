pub use libfabric_sys as sys;
