//! A timeline of every step on a node, as a Chrome trace-event file (open it in Perfetto or
//! `chrome://tracing`).
//!
//! `HIVEMESH_TIMELINE=path.json` in the environment turns it on for the process (one file per
//! process, read once, at the first event; `{pid}` in the path becomes the process id, for
//! processes that share an environment, like a benchmark's workers). Each step writes spans for its matchmaking, linking,
//! round and apply, and the round writes, per member, a span for every part sent to it, every
//! frame received from it, and every frame handled from it (a part's reduction runs inside the
//! handling of its last contribution; an average's application inside the handling of the
//! average). Lanes are named `node <peer>` for the step and `<node> ↔ member <i> <peer>` for a
//! link, so one file from several in-process nodes stays readable. Group operations
//! ([`crate::group`]) write a span per operation on `node <peer> group` and the same per-frame
//! spans on `<node> ↔ group member <i> <peer>`.
//!
//! # Cost and bounds
//!
//! Off (the default), each probe is one check of an initialized `OnceLock`. On, an event is a
//! small struct sent to a writer thread through a bounded channel with `try_send`: the data
//! path never waits on the file, and events that find the channel full are dropped and counted.
//! The file stops growing at `HIVEMESH_TIMELINE_MAX_MB` (default 256 MiB); a last event says
//! how many were dropped. The file is a JSON array written as events come; the trace-event
//! format allows the closing `]` to be missing, so a process killed mid-run still leaves a
//! readable file, and a clean exit ([`flush`]) closes it.

use std::io::Write as _;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::Instant;

/// The environment variable naming the file.
pub const ENV_PATH: &str = "HIVEMESH_TIMELINE";
/// The environment variable bounding its size (MiB).
pub const ENV_MAX_MB: &str = "HIVEMESH_TIMELINE_MAX_MB";
/// Events waiting for the writer thread; more are dropped.
const QUEUE: usize = 64 * 1024;

/// One span (a Chrome "complete" event): `name` on `lane`, from `start` for `duration`.
#[derive(Debug)]
struct Span {
    name: String,
    category: &'static str,
    lane: String,
    start: Instant,
    end: Instant,
    args: Vec<(&'static str, String)>,
}

enum Command {
    Span(Span),
    /// Write out what is buffered; `true`: also close the JSON array (no events after it).
    Flush(SyncSender<()>, bool),
}

struct Writer {
    tx: SyncSender<Command>,
    dropped: AtomicU64,
}

static TIMELINE: OnceLock<Option<Writer>> = OnceLock::new();

/// The process's timeline writer, if `HIVEMESH_TIMELINE` is set (started at the first call).
fn writer() -> Option<&'static Writer> {
    TIMELINE
        .get_or_init(|| {
            let path = std::env::var(ENV_PATH).ok()?;
            // `{pid}` in the path: one file per process when several share the environment
            // (a benchmark's workers).
            let path = path.replace("{pid}", &std::process::id().to_string());
            let max_bytes = std::env::var(ENV_MAX_MB)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(256)
                .saturating_mul(1 << 20);
            let file = match std::fs::File::create(&path) {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(path = ?path, error = %e, "cannot write the timeline");
                    return None;
                }
            };
            let _ = epoch();
            let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
            let spawned = std::thread::Builder::new()
                .name("hivemesh-timeline".into())
                .spawn(move || write_events(file, rx, max_bytes));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start the timeline writer");
                return None;
            }
            Some(Writer {
                tx,
                dropped: AtomicU64::new(0),
            })
        })
        .as_ref()
}

/// Whether the timeline is on.
pub fn enabled() -> bool {
    writer().is_some()
}

/// Where spans are measured from: the writer's epoch, fixed at the first use.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Records a span that ran from `start` to now. Never blocks; a no-op when the timeline is off.
pub(crate) fn span(
    category: &'static str,
    lane: impl FnOnce() -> String,
    name: impl FnOnce() -> String,
    start: Instant,
    args: impl FnOnce() -> Vec<(&'static str, String)>,
) {
    let Some(w) = writer() else { return };
    let span = Span {
        name: name(),
        category,
        lane: lane(),
        start,
        end: Instant::now(),
        args: args(),
    };
    if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
        w.tx.try_send(Command::Span(span))
    {
        w.dropped.fetch_add(1, Ordering::Relaxed);
    }
}

/// Waits until every event recorded so far is in the file, and closes the JSON array if
/// nothing more is to come (`close`). Call at the end of a process; a no-op when off.
pub fn flush(close: bool) {
    let Some(w) = writer() else { return };
    let dropped = w.dropped.swap(0, Ordering::Relaxed);
    if dropped > 0 {
        let now = Instant::now();
        let _ = w.tx.send(Command::Span(Span {
            name: format!("{dropped} events dropped (the writer fell behind)"),
            category: "timeline",
            lane: "timeline".into(),
            start: now,
            end: now,
            args: Vec::new(),
        }));
    }
    let (done, wait) = std::sync::mpsc::sync_channel(1);
    if w.tx.send(Command::Flush(done, close)).is_ok() {
        let _ = wait.recv();
    }
}

/// The writer thread: one JSON object per span, lanes announced by name on first use.
fn write_events(file: std::fs::File, rx: Receiver<Command>, max_bytes: u64) {
    let mut out = std::io::BufWriter::new(file);
    let mut written: u64 = 0;
    let mut lanes: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    let mut full = false;
    let mut closed = false;
    let pid = std::process::id();
    let emit = |out: &mut std::io::BufWriter<std::fs::File>, text: &str, written: &mut u64| {
        let sep = if *written == 0 { "[\n" } else { ",\n" };
        if out.write_all(sep.as_bytes()).is_ok() && out.write_all(text.as_bytes()).is_ok() {
            *written += (sep.len() + text.len()) as u64;
        }
    };
    loop {
        // Whatever is buffered reaches the file whenever the queue runs dry, so a process
        // that exits without `flush` loses at most the events of its last moments.
        let command = match rx.try_recv() {
            Ok(c) => c,
            Err(std::sync::mpsc::TryRecvError::Empty) => {
                let _ = out.flush();
                match rx.recv() {
                    Ok(c) => c,
                    Err(_) => break,
                }
            }
            Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
        };
        match command {
            Command::Flush(done, close) => {
                if close && !closed {
                    if written == 0 {
                        let _ = out.write_all(b"[");
                    }
                    let _ = out.write_all(b"\n]\n");
                    closed = true;
                }
                let _ = out.flush();
                let _ = done.send(());
            }
            Command::Span(_) if full || closed => {}
            Command::Span(span) => {
                let tid = match lanes.get(&span.lane) {
                    Some(&tid) => tid,
                    None => {
                        let tid = lanes.len() as u64 + 1;
                        let meta = format!(
                            "{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\
                             \"args\":{{\"name\":{}}}}}",
                            json_string(&span.lane)
                        );
                        emit(&mut out, &meta, &mut written);
                        lanes.insert(span.lane.clone(), tid);
                        tid
                    }
                };
                let ts = span.start.saturating_duration_since(epoch()).as_nanos() as f64 / 1e3;
                let dur = span.end.saturating_duration_since(span.start).as_nanos() as f64 / 1e3;
                let mut args = String::new();
                for (i, (k, v)) in span.args.iter().enumerate() {
                    if i > 0 {
                        args.push(',');
                    }
                    args.push_str(&json_string(k));
                    args.push(':');
                    args.push_str(&json_string(v));
                }
                let event = format!(
                    "{{\"name\":{},\"cat\":\"{}\",\"ph\":\"X\",\"ts\":{ts:.3},\"dur\":{dur:.3},\
                     \"pid\":{pid},\"tid\":{tid},\"args\":{{{args}}}}}",
                    json_string(&span.name),
                    span.category,
                );
                emit(&mut out, &event, &mut written);
                if written >= max_bytes {
                    let last = format!(
                        "{{\"name\":\"timeline truncated at {max_bytes} bytes\",\"ph\":\"i\",\
                         \"s\":\"g\",\"ts\":{ts:.3},\"pid\":{pid},\"tid\":0}}"
                    );
                    emit(&mut out, &last, &mut written);
                    full = true;
                }
            }
        }
    }
    let _ = out.flush();
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, lane: &str) -> Command {
        let now = Instant::now();
        Command::Span(Span {
            name: name.to_owned(),
            category: "test",
            lane: lane.to_owned(),
            start: now,
            end: now,
            args: vec![("k", "v\"".to_owned())],
        })
    }

    /// Runs the writer over `commands` into a file; returns its text.
    fn write(commands: Vec<Command>, max_bytes: u64) -> String {
        let path = std::env::temp_dir().join(format!(
            "hivemesh-timeline-unit-{}-{max_bytes}.json",
            std::process::id()
        ));
        let (tx, rx) = std::sync::mpsc::sync_channel(commands.len() + 1);
        for c in commands {
            tx.send(c).unwrap();
        }
        drop(tx);
        write_events(std::fs::File::create(&path).unwrap(), rx, max_bytes);
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        text
    }

    #[test]
    fn the_file_is_a_trace_event_array_closed_on_request() {
        let (done, _wait) = std::sync::mpsc::sync_channel(1);
        let text = write(
            vec![
                span("a", "lane 1"),
                span("b", "lane 2"),
                span("c", "lane 1"),
                Command::Flush(done, true),
                span("late", "lane 1"),
            ],
            1 << 20,
        );
        let events: Vec<serde_json::Value> = serde_json::from_str(&text).expect("closed JSON");
        let names: Vec<&str> = events.iter().map(|e| e["name"].as_str().unwrap()).collect();
        // Two lane announcements, three spans; nothing after the close.
        assert_eq!(names, ["thread_name", "a", "thread_name", "b", "c"]);
        assert_eq!(events[1]["tid"], events[4]["tid"]);
        assert_ne!(events[1]["tid"], events[3]["tid"]);
        assert_eq!(events[1]["args"]["k"], "v\"");
        // Not closed: still readable by a trace viewer, which accepts a missing `]`.
        let open = write(vec![span("a", "lane")], 1 << 20);
        assert!(open.starts_with("[\n") && !open.trim_end().ends_with(']'));
        let events: Vec<serde_json::Value> =
            serde_json::from_str(&format!("{open}]")).expect("JSON once closed");
        assert_eq!(events.len(), 2);
    }

    #[test]
    fn the_file_stops_at_its_bound() {
        let spans: Vec<Command> = (0..1000).map(|i| span(&format!("s{i}"), "lane")).collect();
        let text = write(spans, 4096);
        assert!(text.len() < 4096 + 1024, "{} bytes", text.len());
        let events: Vec<serde_json::Value> =
            serde_json::from_str(&format!("{text}]")).expect("JSON");
        let last = events.last().unwrap()["name"].as_str().unwrap();
        assert!(last.starts_with("timeline truncated"), "{last}");
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(
            json_string("a\"b\\c\nd\u{1}é"),
            "\"a\\\"b\\\\c\\nd\\u0001é\""
        );
    }
}
