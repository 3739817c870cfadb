//! The one place that names a logging crate: `defmt` under the `defmt` feature,
//! nothing otherwise. The rest of the core calls `trace!` / `debug!` from here.

#[cfg(feature = "defmt")]
macro_rules! trace {
    ($($arg:tt)*) => { defmt::trace!($($arg)*) };
}

#[cfg(not(feature = "defmt"))]
macro_rules! trace {
    ($($arg:tt)*) => {{}};
}

#[cfg(feature = "defmt")]
macro_rules! debug {
    ($($arg:tt)*) => { defmt::debug!($($arg)*) };
}

#[cfg(not(feature = "defmt"))]
macro_rules! debug {
    ($($arg:tt)*) => {{}};
}

pub(crate) use {debug, trace};
