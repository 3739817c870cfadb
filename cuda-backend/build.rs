//! Build script of kvpage-cuda. Two independent parts, one function each:
//! `build_emulation` (the kernels as host C++ for the emulated tests, feature
//! `emulation`) and the nvcc fatbin (`build_fatbin`, the device side).

fn main() {
    build_emulation();
}

/// With the `emulation` feature: compiles `kernels/host/*.cpp` (the kernel source
/// included as host C++ against `kernels/emulation.hpp`, plus the emulation's own
/// self-test) into the static library `kvpage_emu`, C++17, `-O2` in every profile (the
/// emulator runs each CUDA thread as a fiber: unoptimised it would be several times
/// slower), warnings as errors.
fn build_emulation() {
    println!("cargo:rerun-if-changed=kernels");
    #[cfg(feature = "emulation")]
    {
        let mut sources: Vec<std::path::PathBuf> = std::fs::read_dir("kernels/host")
            .expect("cuda-backend/kernels/host exists")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
            .collect();
        sources.sort();
        let mut build = cc::Build::new();
        build
            .cpp(true)
            .std("c++17")
            .opt_level(2)
            .warnings(true)
            .extra_warnings(true)
            .warnings_into_errors(true)
            .include("kernels");
        // Under `-Zsanitizer=address` (CI's ASan step) the C++ is instrumented too, so
        // that emulation.hpp tells the sanitizer about its fiber switches (unannotated,
        // the runtime maps and unmaps memory on every switch: 50x slower).
        println!("cargo:rerun-if-env-changed=CARGO_CFG_SANITIZE");
        if std::env::var("CARGO_CFG_SANITIZE").is_ok_and(|s| s.split(',').any(|x| x == "address")) {
            build.flag("-fsanitize=address");
        }
        for s in &sources {
            println!("cargo:rerun-if-changed={}", s.display());
            build.file(s);
        }
        build.compile("kvpage_emu");
    }
}
