//! Who published what, and whether that process still runs: the clock and process identity that
//! tell an attempt's own parts and markers from an earlier attempt's ([`super::wait::Freshness`])
//! and a dead publisher from a live one ([`publisher_alive`]).
//!
//! Liveness is knowable only on this host (`/proc`); a publisher on another host is judged by time
//! (see `super::attempt`).

use std::sync::OnceLock;

/// Wall-clock now, ns since the Unix epoch.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// This machine's host name (`/proc/sys/kernel/hostname`), empty when unreadable.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// Where a pid names one process: this host name and this process's pid namespace
/// (`<hostname>#<namespace inode>`). Containers on one machine may share its host name
/// (`docker --network host`) but not their pids, so a publisher's liveness can be told only from
/// the same host and namespace.
pub fn host_id() -> String {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        // `pid:[4026531836]`; empty where /proc does not say.
        let ns: String = std::fs::read_link("/proc/self/ns/pid")
            .map(|l| {
                l.to_string_lossy()
                    .chars()
                    .filter(char::is_ascii_digit)
                    .collect()
            })
            .unwrap_or_default();
        format!("{}#{ns}", hostname())
    })
    .clone()
}

/// This process as a part records it: `host:pid:start` (host as [`host_id`], start in ns since the
/// epoch), unique among the processes of a cluster.
pub fn publisher() -> String {
    format!(
        "{}:{}:{}",
        host_id(),
        std::process::id(),
        process_start_ns()
    )
}

/// A publisher string split into host, pid and start (ns since the epoch); None when malformed.
fn parse_publisher(publisher: &str) -> Option<(&str, u32, u64)> {
    let mut it = publisher.rsplitn(3, ':');
    let (start, pid, host) = (it.next()?, it.next()?, it.next()?);
    Some((host, pid.parse().ok()?, start.parse().ok()?))
}

/// Whether the publisher runs on this host, in this pid namespace ([`host_id`]): its liveness can
/// then be told by [`publisher_alive`]. False for parts of shardwise before the namespace was
/// recorded (their liveness is unknown).
pub fn publisher_on_this_host(publisher: &str) -> bool {
    parse_publisher(publisher).is_some_and(|(host, _, _)| host == host_id())
}

/// Whether the process a part names as its publisher is alive: it runs on this host
/// ([`publisher_on_this_host`]), and a process with its pid started when it did (within 0.1 s; a
/// reused pid started later). `false` when it is gone or runs elsewhere (not knowable from here).
pub fn publisher_alive(publisher: &str) -> bool {
    let Some((host, pid, start)) = parse_publisher(publisher) else {
        return false;
    };
    host == host_id() && process_start_of(pid).is_some_and(|s| s.abs_diff(start) < 100_000_000)
}

/// Wall-clock start of this process, ns since the Unix epoch (see [`process_start_of`]); falls
/// back to now.
pub fn process_start_ns() -> u64 {
    static START: OnceLock<u64> = OnceLock::new();
    *START.get_or_init(|| process_start_of(std::process::id()).unwrap_or_else(now_ns))
}

/// Wall-clock start of process `pid` on this machine, ns since the Unix epoch (Linux:
/// `/proc/<pid>/stat` start time on the boot clock, carried over to the wall clock), rounded up to
/// the end of its clock tick (10 ms): the latest instant it can have started, so that a marker
/// written just before the process started is never taken for one written after. `None` when
/// there is no such process.
pub fn process_start_of(pid: u32) -> Option<u64> {
    let now = now_ns();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22 (starttime, clock ticks since boot); the command name (field 2) may hold spaces,
    // so count from the closing parenthesis.
    let ticks = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(19))
        .and_then(|s| s.parse::<u64>().ok())?;
    // SAFETY: plain libc calls with valid out-pointers.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    if hz <= 0 || unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return None;
    }
    let since_boot = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    let started = (ticks + 1).saturating_mul(1_000_000_000) / hz as u64;
    Some(now.saturating_sub(since_boot.saturating_sub(started)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_gone_or_foreign_one_is_not() {
        let me = publisher();
        assert!(publisher_on_this_host(&me) && publisher_alive(&me), "{me}");
        let (host, pid, start) = parse_publisher(&me).unwrap();
        // Same pid, started a second later: a reused pid, not us.
        let reused = format!("{host}:{pid}:{}", start + 1_000_000_000);
        assert!(publisher_on_this_host(&reused) && !publisher_alive(&reused));
        let foreign = format!("{host}-elsewhere:{pid}:{start}");
        assert!(!publisher_on_this_host(&foreign) && !publisher_alive(&foreign));
        for bad in ["", "nohost", "h:notapid:1", "h:1:notastart"] {
            assert!(
                !publisher_alive(bad) && !publisher_on_this_host(bad),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_host_name_with_colons_is_kept_whole() {
        assert_eq!(parse_publisher("a:b:c:12:34"), Some(("a:b:c", 12, 34)));
    }

    #[test]
    fn this_process_started_before_now() {
        let start = process_start_ns();
        assert!(start <= now_ns() && start > 0);
        let again = process_start_of(std::process::id()).unwrap();
        assert!(again.abs_diff(start) < 50_000_000, "{again} vs {start}");
    }
}
