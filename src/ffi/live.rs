//! The objects this library handed out and has not freed yet: every `fep_*` pointer argument is
//! looked up here before use, so a destroyed (or foreign) buffer, handle, op or bootstrap is
//! `FEP_ERR_INVALID_ARGUMENT` naming the argument, and a second destroy is reported instead of
//! freeing twice.
//!
//! An object may be owned by another (a `fep_ep`'s buffers): it is looked up as any other, but
//! its own `_destroy` call is refused; its owner takes it out with [`take_owned`].
//!
//! NOTES: the registry holds addresses, so a pointer freed and then handed out again for a new
//! object of the same type passes as that new object (the allocator may reuse the address);
//! everything else stale is caught. One lock per lookup (tens of nanoseconds).

use std::any::type_name;
use std::collections::HashMap;

use parking_lot::Mutex;

use crate::error::Error;

/// A live object: its type and, when another object owns it, the owner's name (for the error).
#[derive(Clone, Copy)]
struct Entry {
    ty: &'static str,
    owner: Option<&'static str>,
}

static LIVE: Mutex<Option<HashMap<usize, Entry>>> = Mutex::new(None);

/// Boxes `v`, records it live and returns the pointer handed to C.
pub(crate) fn boxed<T>(v: T) -> *mut T {
    let p = Box::into_raw(Box::new(v));
    LIVE.lock()
        .get_or_insert_with(HashMap::new)
        .insert(p as usize, Entry { ty: type_name::<T>(), owner: None });
    p
}

fn is_live<T>(p: *const T) -> bool {
    LIVE.lock()
        .as_ref()
        .and_then(|m| m.get(&(p as usize)))
        .is_some_and(|e| e.ty == type_name::<T>())
}

/// Marks the live object `p` as owned by `owner` (a type name for the error of its `_destroy`):
/// from now on only [`take_owned`] frees it. False when `p` is not a live `T`.
pub(crate) fn set_owner<T>(p: *const T, owner: &'static str) -> bool {
    let mut g = LIVE.lock();
    match g.as_mut().and_then(|m| m.get_mut(&(p as usize))) {
        Some(e) if e.ty == type_name::<T>() => {
            e.owner = Some(owner);
            true
        }
        _ => false,
    }
}

fn stale(name: &'static str) -> Error {
    Error::arg(name, "not a live object of this library (destroyed already, or never created)")
}

/// The live object `p` points to (`name`: the argument, for the error).
///
/// # Safety
/// No other reference to the object may be alive during the call (the C ABI's calls on one
/// object are sequential, as the header documents).
pub(crate) unsafe fn get<'a, T>(p: *const T, name: &'static str) -> Result<&'a mut T, Error> {
    if p.is_null() {
        return Err(Error::arg(name, "NULL pointer"));
    }
    if !is_live(p) {
        return Err(stale(name));
    }
    Ok(&mut *p.cast_mut())
}

/// `get`, with NULL as `None`.
///
/// # Safety
/// As [`get`].
pub(crate) unsafe fn get_opt<'a, T>(
    p: *const T,
    name: &'static str,
) -> Result<Option<&'a mut T>, Error> {
    if p.is_null() {
        Ok(None)
    } else {
        get(p, name).map(Some)
    }
}

/// Takes `p` out of the registry and back into a box (an error when it is not live).
///
/// # Safety
/// `p` must not be used afterwards.
pub(crate) unsafe fn take<T>(p: *mut T, name: &'static str) -> Result<Box<T>, Error> {
    take_if(p, name, false)
}

/// [`take`] of an object marked owned by [`set_owner`] (its owner's destroy).
///
/// # Safety
/// As [`take`].
pub(crate) unsafe fn take_owned<T>(p: *mut T, name: &'static str) -> Result<Box<T>, Error> {
    take_if(p, name, true)
}

unsafe fn take_if<T>(p: *mut T, name: &'static str, owned: bool) -> Result<Box<T>, Error> {
    {
        let mut g = LIVE.lock();
        let m = g.get_or_insert_with(HashMap::new);
        match m.get(&(p as usize)).copied() {
            Some(e) if e.ty == type_name::<T>() => match e.owner {
                Some(owner) if !owned => {
                    return Err(Error::arg(
                        name,
                        format!(
                            "owned by a {owner}, which frees it: destroy the {owner} instead \
                             ({owner}_destroy)"
                        ),
                    ))
                }
                None if owned => return Err(stale(name)),
                _ => {
                    m.remove(&(p as usize));
                }
            },
            _ => return Err(stale(name)),
        }
    }
    Ok(Box::from_raw(p))
}

/// The `_destroy` calls that return nothing: frees `p` when live (NULL is a no-op); a stale
/// pointer is left alone and recorded as the thread's last error.
///
/// # Safety
/// As [`take`].
pub(crate) unsafe fn free<T>(p: *mut T, name: &'static str) {
    if p.is_null() {
        return;
    }
    match take(p, name) {
        Ok(b) => super::free_boxed(Box::into_raw(b)),
        Err(e) => super::status::set_last_error(&e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_and_foreign_pointers_are_refused() {
        let p = boxed(41u64);
        unsafe {
            *get(p, "x").unwrap() += 1;
            assert_eq!(*get(p, "x").unwrap(), 42);
            // Another type at the same address is not this object.
            assert!(get(p.cast::<u32>(), "x").is_err());
            let b = take(p, "x").unwrap();
            assert_eq!(*b, 42);
            assert!(get(p, "x").unwrap_err().to_string().contains("not a live object"));
            assert!(take(p, "x").is_err(), "a second destroy is refused");
            let q: *mut u64 = std::ptr::null_mut();
            assert!(get(q, "x").unwrap_err().to_string().contains("NULL"));
            free(q, "x"); // NULL: a no-op
            let local = 7u64;
            assert!(get(&local as *const u64, "x").is_err(), "never created here");
        }
    }

    #[test]
    fn an_owned_object_is_freed_by_its_owner_only() {
        let p = boxed(5u32);
        assert!(set_owner(p, "fep_ep"));
        assert!(!set_owner(p.cast::<u64>(), "fep_ep"), "another type is not this object");
        unsafe {
            assert_eq!(*get(p, "buf").unwrap(), 5, "an owned object is used as any other");
            let e = take(p, "buf").unwrap_err().to_string();
            assert!(e.contains("`buf`") && e.contains("fep_ep_destroy"), "{e}");
            free(p, "buf");
            assert!(get(p, "buf").is_ok(), "a refused free leaves it live");
            assert_eq!(*take_owned(p, "buf").unwrap(), 5);
            assert!(take_owned(p, "buf").is_err(), "a second take is refused");
            let q = boxed(6u32);
            assert!(take_owned(q, "buf").is_err(), "an object nobody owns is not taken so");
            assert_eq!(*take(q, "buf").unwrap(), 6);
        }
    }
}
