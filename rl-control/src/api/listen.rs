//! Where the admin API listens, and who may drive it:
//! - the Unix socket `api.sock` in the runtime directory, mode 0600: root
//!   only, no token (the default, always on);
//! - TCP (`--api` / `[api] listen`) only with `[api] token_file`, loopback
//!   included (every local user can reach loopback);
//! - `[api] metrics_listen`: `/metrics` and `/healthz` only, read-only, no
//!   token, for scrapers.
//!
//! Everything is bound before the interface is touched.

use std::{
    net::SocketAddr,
    os::unix::fs::{DirBuilderExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{bail, Context, Result};
use tokio::net::{TcpListener, UnixListener};
use tracing::{error, info};

use super::{metrics_router, router, Api};
use crate::{cli::API_SOCKET, config::Config, daemon::state::Shared};

/// The bound listeners and the token TCP requires.
pub struct Listeners {
    socket: UnixListener,
    socket_path: PathBuf,
    /// Removes the socket when dropped: also when the start fails after
    /// binding it.
    socket_file: SocketFile,
    tcp: Option<TcpListener>,
    metrics: Option<TcpListener>,
    token: Option<Arc<str>>,
}

/// Reads `[api] token_file`, refusing one that group or others can read or
/// write, or that another user owns (whoever can change it holds the API).
/// Checked on the open file: what is read is what was checked.
fn read_token(config: &Config) -> Result<Option<Arc<str>>> {
    use std::{io::Read, os::unix::fs::MetadataExt};
    let Some(f) = &config.api.token_file else {
        return Ok(None);
    };
    let cannot = || {
        format!(
            "cannot read the API token file {} ([api] token_file)",
            f.display()
        )
    };
    let mut file = std::fs::File::open(f).with_context(cannot)?;
    let meta = file.metadata().with_context(cannot)?;
    let mode = meta.permissions().mode();
    if mode & 0o066 != 0 {
        bail!(
            "the API token file {} can be read or written by group or others (mode {:03o}): make it the owner's alone with `chmod 600 {}`",
            f.display(),
            mode & 0o777,
            f.display()
        );
    }
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        bail!("the API token file {} is owned by uid {}, not this daemon's user ({me}): whoever owns it holds the API; `chown {me} {}`", f.display(), meta.uid(), f.display());
    }
    let mut t = String::new();
    file.read_to_string(&mut t).with_context(cannot)?;
    let t = t.trim();
    if t.is_empty() {
        bail!(
            "the API token file {} is empty: put a long random token in it",
            f.display()
        );
    }
    Ok(Some(Arc::from(t)))
}

/// Binds the socket `api.sock` in `runtime_dir` (mode 0600; refusing if a
/// live daemon serves it), and the TCP listeners the options and config ask
/// for (TCP only with a token).
pub async fn bind(
    runtime_dir: &Path,
    api: Option<SocketAddr>,
    config: &Config,
) -> Result<Listeners> {
    let token = read_token(config)?;
    let tcp_addr = api.or(config.api.listen);
    if let (Some(addr), None) = (tcp_addr, &token) {
        bail!(
            "refusing to serve the admin API on {addr} without a token: anyone who can reach it (on loopback, every local user) \
             could change the rules; set [api] token_file, or use the Unix socket in the runtime directory (root only, the default)"
        );
    }
    if let Some(addr) = tcp_addr.filter(|a| !a.ip().is_loopback()) {
        tracing::warn!("the admin API on {addr} is plain HTTP: its bearer token crosses the network in clear; keep [api] listen on loopback, or put a TLS proxy in front");
    }
    // Made 0755 whatever the umask leaves (a group-writable one is refused).
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(runtime_dir)
        .with_context(|| {
            format!(
                "cannot create the runtime directory {} (--runtime-dir)",
                runtime_dir.display()
            )
        })?;
    root_only(runtime_dir)?;
    let socket_path = runtime_dir.join(API_SOCKET);
    // Held for the daemon's life: of two starts on one runtime directory,
    // one serves and the other stops before touching the socket.
    let lock = lock_runtime_dir(runtime_dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock => {
            anyhow::anyhow!("another rl-control is serving {}: stop it first, or give this one another --runtime-dir", socket_path.display())
        }
        _ => anyhow::anyhow!("cannot lock {}: {e}: run rl-control as root", runtime_dir.join("api.lock").display()),
    })?;
    if socket_path.exists() {
        // A daemon of an older build takes no lock: its socket answers.
        if std::os::unix::net::UnixStream::connect(&socket_path).is_ok() {
            bail!("another rl-control is serving {}: stop it first, or give this one another --runtime-dir", socket_path.display());
        }
        std::fs::remove_file(&socket_path)
            .with_context(|| format!("cannot remove the stale socket {}", socket_path.display()))?;
    }
    // Created 0600 from the start: no moment in which others may connect.
    let old = unsafe { libc::umask(0o177) };
    let socket = UnixListener::bind(&socket_path);
    unsafe { libc::umask(old) };
    let socket = socket.with_context(|| {
        format!(
            "cannot listen on {} for the admin API",
            socket_path.display()
        )
    })?;
    let socket_file = SocketFile(socket_path.clone(), lock);
    let tcp = bind_tcp(tcp_addr, "the admin API", "--api").await?;
    let metrics = bind_tcp(
        config.api.metrics_listen,
        "the metrics listener",
        "[api] metrics_listen",
    )
    .await?;
    Ok(Listeners {
        socket,
        socket_path,
        socket_file,
        tcp,
        metrics,
        token,
    })
}

/// Refuses a runtime directory that another user owns or that group or
/// others may write: whoever may write there may put a socket of their own
/// in place of the daemon's (and the CLI would send them its token).
fn root_only(dir: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir)
        .with_context(|| format!("cannot read the runtime directory {}", dir.display()))?;
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o022 != 0 {
        bail!(
            "the runtime directory {} is owned by uid {} with mode {:o}: only root may write where the admin socket lives; \
             make it root's and not group- or world-writable, or give another --runtime-dir",
            dir.display(),
            meta.uid(),
            meta.mode() & 0o7777
        );
    }
    Ok(())
}

/// Takes `api.lock` in `dir` (made 0600), failing if another daemon holds it.
fn lock_runtime_dir(dir: &Path) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::{fd::AsRawFd, unix::fs::OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir.join("api.lock"))?;
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(f.into())
}

/// Binds `addr`, if given, for `what` (set by `setting`), failing with one
/// line if it is taken. Every TCP listener of the daemon is bound this way,
/// before the interface is touched.
pub async fn bind_tcp(
    addr: Option<SocketAddr>,
    what: &str,
    setting: &str,
) -> Result<Option<TcpListener>> {
    let Some(addr) = addr else { return Ok(None) };
    TcpListener::bind(addr).await.map(Some).with_context(|| {
        format!("cannot listen on {addr} for {what}: is another rl-control running? choose another address with {setting}")
    })
}

/// Serves the API on every listener until the returned tasks are aborted.
/// The socket file is removed when the returned guard drops.
pub fn serve(l: Listeners, state: Shared) -> (Vec<tokio::task::JoinHandle<()>>, SocketFile) {
    let mut tasks = Vec::new();
    let app = router(Api {
        state: state.clone(),
        token: None,
    });
    tasks.push(tokio::spawn(async move {
        if let Err(e) = axum::serve(l.socket, app).await {
            error!("the admin API (socket) stopped: {e}");
        }
    }));
    info!("admin API on {} (root only)", l.socket_path.display());
    let at = |l: &TcpListener| l.local_addr().map(|a| a.to_string()).unwrap_or_default();
    if let Some(listener) = l.tcp {
        let addr = at(&listener);
        let app = router(Api {
            state: state.clone(),
            token: l.token.clone(),
        });
        tasks.push(tokio::spawn(serve_tcp(listener, app, "the admin API")));
        info!("admin API on http://{addr} (bearer token required for /v1)");
    }
    if let Some(listener) = l.metrics {
        let addr = at(&listener);
        let app = metrics_router(Api { state, token: None });
        tasks.push(tokio::spawn(serve_tcp(
            listener,
            app,
            "the metrics listener",
        )));
        info!("metrics on http://{addr}/metrics (read-only, no token)");
    }
    (tasks, l.socket_file)
}

/// Open connections one TCP listener holds at most: far more than scrapers
/// and admin clients need, and far fewer than the daemon's open files,
/// which its maps and files need too.
const MAX_TCP_CONNECTIONS: usize = 256;

/// Serves `app` on a TCP listener: past [`MAX_TCP_CONNECTIONS`] open ones a
/// new connection is closed at once (warned at most once a minute), and a
/// client that does not send its request head within 30 s is dropped
/// ([`crate::http1`]), so whoever can reach the port (before any token is
/// checked) cannot take the daemon's open files.
async fn serve_tcp(listener: TcpListener, app: axum::Router, what: &'static str) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_TCP_CONNECTIONS));
    let mut warned: Option<std::time::Instant> = None;
    loop {
        let (s, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors, say: serve the open connections
                // and try again shortly.
                tracing::warn!("{what}: accepting a connection failed: {e}; retrying in 100 ms");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            if warned.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(60)) {
                warned = Some(std::time::Instant::now());
                tracing::warn!("{what}: {MAX_TCP_CONNECTIONS} connections open: closing new ones (this one from {peer}) until some close");
            }
            continue;
        };
        let app = app.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::http1::serve(s, app).await {
                tracing::debug!("{what}: a connection from {peer} ended: {e}");
            }
            drop(permit);
        });
    }
}

/// Removes the socket file when the daemon exits, then lets the runtime
/// directory's lock go.
pub struct SocketFile(PathBuf, #[allow(dead_code)] std::os::fd::OwnedFd);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
