//! Checks of the pointers and lengths a C caller passes, turning them into references
//! and slices or into a [`Fail`]. Nothing here dereferences a pointer before checking it
//! is non-null and aligned; what cannot be checked (that memory is live and large
//! enough) is the caller's side of each function's contract.

use super::result::{kvpage_result, Fail};

fn check_ptr<T>(ptr: *const T, what: &'static str) -> Result<(), Fail> {
    if ptr.is_null() {
        return Err(Fail::null(what));
    }
    if !ptr.is_aligned() {
        return Err(Fail::new(kvpage_result::KVPAGE_ERR_MISALIGNED, what));
    }
    Ok(())
}

fn check_len<T>(len: usize, what: &'static str) -> Result<(), Fail> {
    match len.checked_mul(core::mem::size_of::<T>()) {
        Some(bytes) if bytes <= isize::MAX as usize => Ok(()),
        _ => Err(Fail::invalid(what).with_value(len as u64)),
    }
}

/// `&T` from a pointer the caller promised is valid when non-null.
///
/// # Safety
/// A non-null `ptr` points to a live `T` not mutated during `'a`.
pub(crate) unsafe fn obj<'a, T>(ptr: *const T, what: &'static str) -> Result<&'a T, Fail> {
    check_ptr(ptr, what)?;
    // SAFETY: non-null and aligned here; live and unaliased by the caller's contract.
    Ok(unsafe { &*ptr })
}

/// An input array of `len` elements; `len == 0` gives an empty slice whatever `ptr`
/// is (NULL allowed).
///
/// # Safety
/// A non-null `ptr` with `len > 0` points to `len` initialised `T` not mutated during
/// `'a`.
pub(crate) unsafe fn slice<'a, T>(
    ptr: *const T,
    len: usize,
    what: &'static str,
) -> Result<&'a [T], Fail> {
    if len == 0 {
        return Ok(&[]);
    }
    check_ptr(ptr, what)?;
    check_len::<T>(len, what)?;
    // SAFETY: non-null, aligned, byte size within isize; contents by the caller.
    Ok(unsafe { core::slice::from_raw_parts(ptr, len) })
}

/// An output array of `len` elements; `len == 0` gives an empty slice whatever `ptr`
/// is (NULL allowed).
///
/// # Safety
/// A non-null `ptr` with `len > 0` points to `len` writable, initialised `T` used by
/// nothing else during `'a`.
pub(crate) unsafe fn slice_mut<'a, T>(
    ptr: *mut T,
    len: usize,
    what: &'static str,
) -> Result<&'a mut [T], Fail> {
    if len == 0 {
        return Ok(&mut []);
    }
    check_ptr(ptr, what)?;
    check_len::<T>(len, what)?;
    // SAFETY: non-null, aligned, byte size within isize; exclusive by the caller.
    Ok(unsafe { core::slice::from_raw_parts_mut(ptr, len) })
}

/// An out-parameter, checked before any work so that a bad pointer fails the call
/// without side effects; written with [`Out::set`] only once the work succeeded.
pub(crate) struct Out<T>(*mut T);

impl<T> Out<T> {
    /// Stores the result.
    pub(crate) fn set(self, value: T) {
        // SAFETY: checked non-null and aligned in `out`; writable by the caller's
        // contract. `write` reads nothing of the old contents.
        unsafe { self.0.write(value) }
    }
}

/// Checks an out-parameter.
///
/// # Safety
/// A non-null `ptr` points to memory writable for one `T`, untouched by anything else
/// until [`Out::set`] (or the end of the call).
pub(crate) unsafe fn out<T>(ptr: *mut T, what: &'static str) -> Result<Out<T>, Fail> {
    check_ptr(ptr, what)?;
    Ok(Out(ptr))
}

/// An optional out-parameter: `None` for NULL.
///
/// # Safety
/// As [`out`].
pub(crate) unsafe fn out_opt<T>(ptr: *mut T, what: &'static str) -> Result<Option<Out<T>>, Fail> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    unsafe { out(ptr, what) }.map(Some)
}

/// An object of the C API that holds a magic word, so a pointer to anything else
/// (uninitialised memory, another type, a freed object whose word was cleared) is
/// refused before a reference to it is made.
///
/// # Safety
/// `Self` is `#[repr(C)]` and its first field is a `u64` that holds `MAGIC` in every
/// live object of the type, so checking a pointer reads only its first 8 bytes.
pub(crate) unsafe trait Tagged {
    /// The magic word of live objects.
    const MAGIC: u64;
    /// The argument name in error messages.
    const WHAT: &'static str;
    /// The message when the magic word is missing.
    const NOT_LIVE: &'static str;
}

/// Checks `ptr` for null, alignment and the magic word.
///
/// # Safety
/// A non-null, aligned `ptr` points to at least 8 readable bytes.
unsafe fn check_tagged<T: Tagged>(ptr: *const T) -> Result<(), Fail> {
    check_ptr(ptr, T::WHAT)?;
    // SAFETY: non-null and aligned for `T`, hence for the `u64` at its offset 0 (the
    // trait's contract); 8 bytes readable by the caller's contract.
    if unsafe { ptr.cast::<u64>().read() } != T::MAGIC {
        return Err(Fail::invalid(T::NOT_LIVE));
    }
    Ok(())
}

/// `&T` of a [`Tagged`] object, checked for null, alignment and the magic word.
///
/// # Safety
/// A non-null, aligned `ptr` points to at least 8 readable bytes; when they hold the
/// magic word it is a live `T` not mutated during `'a`.
pub(crate) unsafe fn tagged<'a, T: Tagged>(ptr: *const T) -> Result<&'a T, Fail> {
    // SAFETY: forwarded contract; a live `T` once the magic word matched.
    unsafe {
        check_tagged(ptr)?;
        Ok(&*ptr)
    }
}

/// `&mut T` of a [`Tagged`] object, checked as [`tagged`].
///
/// # Safety
/// As [`tagged`], and the object is used by nothing else during `'a`.
pub(crate) unsafe fn tagged_mut<'a, T: Tagged>(ptr: *mut T) -> Result<&'a mut T, Fail> {
    // SAFETY: forwarded contract; a live, exclusive `T` once the magic word matched.
    unsafe {
        check_tagged(ptr)?;
        Ok(&mut *ptr)
    }
}

/// Frees a [`Tagged`] object that `_new` boxed: NULL is a no-op; anything without the
/// magic word is refused and left alone; otherwise the word is cleared (so a second
/// free is usually refused) and the box dropped. O(the object's drop).
///
/// # Safety
/// As [`tagged_mut`]; a live object came from `Box::into_raw` and is used by nothing
/// else, now or later.
pub(crate) unsafe fn free_boxed<T: Tagged>(ptr: *mut T) -> Result<(), Fail> {
    if ptr.is_null() {
        return Ok(());
    }
    // SAFETY: checked live by `check_tagged`; the magic is the u64 at offset 0 (the
    // trait's contract); the box is the caller's to give back.
    unsafe {
        check_tagged(ptr)?;
        ptr.cast::<u64>().write(0);
        drop(Box::from_raw(ptr));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::result::kvpage_result::*;

    #[test]
    fn null_misaligned_and_oversized_are_refused_before_any_read() {
        let words = [0u32; 4];
        // SAFETY: every call either refuses the pointer or reads `words`.
        unsafe {
            assert_eq!(
                slice::<u32>(core::ptr::null(), 3, "a").unwrap_err().code,
                KVPAGE_ERR_NULL_POINTER
            );
            assert!(slice::<u32>(core::ptr::null(), 0, "a").unwrap().is_empty());
            let odd = (words.as_ptr() as *const u8).add(1) as *const u32;
            assert_eq!(slice(odd, 1, "a").unwrap_err().code, KVPAGE_ERR_MISALIGNED);
            assert_eq!(
                slice(words.as_ptr(), usize::MAX / 2, "a").unwrap_err().code,
                KVPAGE_ERR_INVALID_ARGUMENT
            );
            assert_eq!(slice(words.as_ptr(), 4, "a").unwrap(), &words);
            assert!(out_opt::<u32>(core::ptr::null_mut(), "o")
                .unwrap()
                .is_none());
        }
    }
}
