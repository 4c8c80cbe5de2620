//! Serving one HTTP/1.1 connection, as the admin API's TCP listeners and
//! the request check do: a client that never finishes its request head
//! within 30 s is dropped, so whoever reaches a port cannot hold its
//! connections idle for good.

/// Serves `app` on `stream` until the connection ends; why it ended, if
/// not cleanly.
pub async fn serve(stream: tokio::net::TcpStream, app: axum::Router) -> Result<(), hyper::Error> {
    let svc = hyper_util::service::TowerToHyperService::new(app);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(std::time::Duration::from_secs(30));
    http.serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
        .await
}
