//! The metrics listener's connection policy. Regression: 1,100 idle connections to
//! `--metrics-listen` took the descriptors rank 0 needed to write its artifacts (exit 3), and
//! 1,000 half-sent request heads held ~439 KiB each with no deadline. Now the listener holds
//! a fixed number of connections (kept back from the gRPC cap too), closes the rest at once,
//! gives a request head a deadline and a size cap, and serves one request per connection.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use stageb::metrics_endpoint::{MetricsLimits, recorder, serve_with};

fn start(limits: MetricsLimits) -> (tokio::runtime::Runtime, SocketAddr) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let addr = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handle = recorder().unwrap();
        tokio::spawn(serve_with(listener, handle, limits, std::future::pending()));
        addr
    });
    (runtime, addr)
}

/// Reads until the peer closes; `None` if it is still open after `within`.
fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Some(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(got),
            Err(_) => return None,
        }
    }
}

fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let got = closed_within(&mut s, Duration::from_secs(5)).expect("the scrape ends");
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn a_flood_of_half_sent_metrics_requests_is_capped_and_timed_out_and_scrapes_resume() {
    let limits = MetricsLimits {
        max_connections: 4,
        header_timeout: Duration::from_millis(400),
        connection_timeout: Duration::from_secs(5),
    };
    let (_rt, addr) = start(limits);
    let mut held: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: ").unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    // Beyond the cap: closed at once, nothing served.
    let mut extra = TcpStream::connect(addr).unwrap();
    let _ = extra.write_all(b"GET /metrics HTTP/1.1\r\n\r\n");
    let got = closed_within(&mut extra, Duration::from_millis(300)).expect("closed at once");
    assert!(!String::from_utf8_lossy(&got).contains("200 OK"));
    // The half-sent heads are dropped at their deadline.
    let start = Instant::now();
    for s in &mut held {
        assert!(closed_within(s, Duration::from_secs(3)).is_some());
    }
    assert!(start.elapsed() < Duration::from_secs(3));
    // Slots are free again: a real scrape gets the exposition.
    let response = scrape(addr);
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
}

#[test]
fn an_oversized_request_head_is_refused_and_one_request_is_served_per_connection() {
    let (_rt, addr) = start(MetricsLimits::default());
    let mut s = TcpStream::connect(addr).unwrap();
    let big = format!(
        "GET /metrics HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(64 * 1024)
    );
    let _ = s.write_all(big.as_bytes());
    let got = closed_within(&mut s, Duration::from_secs(3)).expect("closed");
    assert!(!String::from_utf8_lossy(&got).contains("200 OK"));
    // Two pipelined requests: one answer, then the connection closes.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .unwrap();
    let got = closed_within(&mut s, Duration::from_secs(3)).expect("closed after one answer");
    assert_eq!(
        String::from_utf8_lossy(&got)
            .matches("HTTP/1.1 200")
            .count(),
        1
    );
    // Other paths and methods.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        .unwrap();
    let got = closed_within(&mut s, Duration::from_secs(3)).unwrap();
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 405"));
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let got = closed_within(&mut s, Duration::from_secs(3)).unwrap();
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 404"));
}
