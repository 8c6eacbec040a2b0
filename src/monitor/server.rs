//! The monitor's web server (axum): the page (`/`, `/app.js`, both compiled into the binary)
//! and its data as JSON (`/api/state`, a [`Snapshot`](super::Snapshot)). The page polls the
//! JSON and draws everything itself; its Content-Security-Policy allows its own script only,
//! so even a string that reached the page as HTML could not run a script.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Json};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::shell::Monitor;

/// The page.
const PAGE: &str = include_str!("page.html");
/// Its script.
const SCRIPT: &str = include_str!("app.js");
/// Only the page's own script and requests; inline styles only.
const CSP: &str = "default-src 'none'; script-src 'self'; connect-src 'self'; \
                   style-src 'unsafe-inline'; img-src 'self'; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

fn headers(content_type: &'static str) -> [(header::HeaderName, &'static str); 4] {
    [
        (header::CONTENT_TYPE, content_type),
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::CACHE_CONTROL, "no-store"),
    ]
}

async fn page() -> impl IntoResponse {
    (headers("text/html; charset=utf-8"), PAGE)
}

async fn script() -> impl IntoResponse {
    (headers("text/javascript; charset=utf-8"), SCRIPT)
}

async fn state(State(monitor): State<Arc<Monitor>>) -> impl IntoResponse {
    (headers("application/json"), Json(monitor.snapshot()))
}

/// The running server; [`MonitorServer::shutdown`] stops it.
#[derive(Debug)]
pub struct MonitorServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl MonitorServer {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets requests under way finish for at most 5 s, then stops.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if tokio::time::timeout(Duration::from_secs(5), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

impl Drop for MonitorServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `monitor`'s page on `listen` (port 0 picks one: see
/// [`MonitorServer::local_addr`]).
pub async fn serve(listen: SocketAddr, monitor: Arc<Monitor>) -> std::io::Result<MonitorServer> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let app = Router::new()
        .route("/", get(page))
        .route("/app.js", get(script))
        .route("/api/state", get(state))
        .with_state(monitor);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });
    Ok(MonitorServer {
        addr,
        stop: Some(stop),
        task,
    })
}
