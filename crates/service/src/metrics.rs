//! Every Prometheus metric `vacancy` exports, defined in one place.
//!
//! Names carry the `vacancy_` prefix and their base unit; labels are bounded
//! (operation, route, status, reason), never a hotel, city or booking id:
//! per-hotel detail belongs in the API, not in label sets that grow without
//! limit. Hot paths count per transaction or per batch, not per row.

use std::sync::LazyLock;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

pub static REGISTRY: LazyLock<Registry> = LazyLock::new(|| {
    let r = Registry::new();
    // Resident memory and CPU of this process: the memory figures need them.
    #[cfg(target_os = "linux")]
    let _ = r.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ));
    r
});

fn register<C: prometheus::core::Collector + Clone + 'static>(c: C) -> C {
    REGISTRY
        .register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

fn counter(name: &str, help: &str) -> IntCounter {
    register(IntCounter::new(name, help).expect("valid metric"))
}

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
}

fn gauge(name: &str, help: &str) -> IntGauge {
    register(IntGauge::new(name, help).expect("valid metric"))
}

fn float_gauge(name: &str, help: &str) -> prometheus::Gauge {
    register(prometheus::Gauge::new(name, help).expect("valid metric"))
}

fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    register(
        Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
            .expect("valid metric"),
    )
}

// --- stream -----------------------------------------------------------------

pub static STREAM_CONNECTED: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_stream_connected",
        "1 while the replication connection is streaming",
    )
});
pub static STREAM_SILENT_CATCH_UP: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_stream_silent_catch_up_total",
        "Receive timeouts (stream.receive_timeout_ms) not taken for a dead connection because the session's walsender was reading on through old WAL it sends nothing of (a long open transaction held the slot's restart position back)",
    )
});
pub static CHANGES_APPLIED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_stream_changes_applied_total",
        "Row changes applied to the copy, by operation",
        &["op"],
    )
});
pub static TRANSACTIONS_APPLIED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_stream_transactions_applied_total",
        "Owner transactions applied to the copy",
    )
});
pub static TRANSACTIONS_SKIPPED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_stream_transactions_skipped_total",
        "Transactions delivered again after a reconnect and skipped (already applied)",
    )
});
pub static APPLY_DURATION: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "vacancy_stream_apply_duration_seconds",
        "Time to apply one transaction to the copy",
        vec![
            1e-6, 5e-6, 2e-5, 1e-4, 5e-4, 2e-3, 1e-2, 5e-2, 0.25, 1.0, 5.0,
        ],
    )
});
/// Buckets for the stream's per-transaction delays: from a millisecond
/// (a commit delivered and applied at once) to a minute (a walsender that
/// decodes far behind, a loop that stalls).
fn delay_buckets() -> Vec<f64> {
    vec![
        0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 60.0,
    ]
}
pub static COMMIT_TO_RECEIVE: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "vacancy_stream_commit_to_receive_seconds",
        "Per transaction applied: the owner's commit timestamp to the replication loop having its commit (the owner's clock against this host's; 0 when this host's is behind). Long: the owner's walsender delivered it late, or the loop was not reading",
        delay_buckets(),
    )
});
pub static RECEIVE_TO_APPLY: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "vacancy_stream_receive_to_apply_seconds",
        "Per transaction applied: the replication loop having its commit to the copy publishing it (outbox place, index note, apply)",
        delay_buckets(),
    )
});
pub static LOOP_STALLS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_stream_loop_stalls_total",
        "Transactions after which the replication loop was away from the stream for 250 ms or more (each one logged with where the time went)",
    )
});
pub static LAG_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_stream_lag_bytes",
        "WAL bytes between the owner's position and what the copy applied",
    )
});
pub static LAG_SECONDS: LazyLock<prometheus::Gauge> = LazyLock::new(|| {
    float_gauge(
        "vacancy_stream_lag_seconds",
        "How far behind the owner the copy is, in time",
    )
});
pub static SECONDS_SINCE_LAST_MESSAGE: LazyLock<prometheus::Gauge> = LazyLock::new(|| {
    float_gauge(
        "vacancy_stream_seconds_since_last_message",
        "Seconds since the stream last delivered a message",
    )
});
pub static RECONNECTS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_stream_reconnects_total",
        "Replication sessions that ended in an error and were retried",
    )
});
pub static RESNAPSHOTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_resnapshots_total",
        "Copies rebuilt from a new snapshot, by reason (initial, slot_missing, slot_lost, slot_ahead, requested, owner_changed)",
        &["reason"],
    )
});
pub static OWNER_CHANGES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_owner_changes_total",
        "Replication sessions that found another owner system identifier or timeline than the last one (a failover): each takes a new snapshot",
    )
});
pub static OWNER_CONNECTIONS_REFUSED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_owner_connections_refused_total",
        "Ordinary owner connections dropped because they reached another system or timeline than the replication stream (a multi-host owner.url during a failover)",
    )
});
pub static SNAPSHOT_ROWS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_snapshot_rows_loaded_total",
        "Rows read from snapshots",
    )
});
pub static SNAPSHOT_PROGRESS: LazyLock<prometheus::Gauge> = LazyLock::new(|| {
    float_gauge(
        "vacancy_snapshot_progress_ratio",
        "Progress of the current snapshot load, 0 to 1",
    )
});
pub static BUFFERED_CHANGES: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_stream_buffered_changes",
        "Row changes held for transactions that have not committed yet",
    )
});
pub static HELD_SPILLED_TRANSACTIONS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_held_spilled_transactions_total",
        "Held transactions that passed stream.max_held_bytes and were spilled to a file in stream.spill_dir (counted at their commit)",
    )
});
pub static HELD_SPILLED_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_held_spilled_bytes_total",
        "Bytes written to spill files by held transactions that committed",
    )
});
pub static SLOT_RETAINED_WAL: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_slot_retained_wal_bytes",
        "WAL the owner keeps for the slot (pg_replication_slots)",
    )
});
pub static READY: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_ready",
        "1 while /readyz answers 200 (snapshot loaded, lag under http.ready_max_lag_ms)",
    )
});
pub static SLOT_ACTIVE: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_slot_active",
        "1 when the slot has an active walsender",
    )
});

// --- read model -------------------------------------------------------------

pub static MODEL_ENTRIES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(
        IntGaugeVec::new(
            Opts::new(
                "vacancy_model_entries",
                "Entries in the read model, by table",
            ),
            &["table"],
        )
        .expect("valid metric"),
    )
});
pub static MODEL_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_model_inventory_bytes",
        "Bytes of packed nightly counts held",
    )
});

pub static TTL_ROWS_REREAD: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_ttl_rows_reread_total",
        "Inventory rows re-read from the owner because their calendar's TTL ran out",
    )
});
pub static TTL_ROWS_REPAIRED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_ttl_rows_repaired_total",
        "Nights a TTL re-read found different in the copy (a change the stream did not deliver)",
    )
});
pub static TTL_READS_DEFERRED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_ttl_reads_deferred_total",
        "TTL re-reads given up because the owner still hid a commit the stream had delivered (synchronous replication waiting on a standby, say); their calendars are queued again",
    )
});
pub static TTL_DUE: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_ttl_due_calendars",
        "Calendars whose TTL ran out, waiting for a re-read",
    )
});

// --- index ----------------------------------------------------------------

pub static INDEX_DOCUMENTS: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_index_documents",
        "Hotel documents in the search index",
    )
});
pub static INDEX_SEGMENTS: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("vacancy_index_segments", "Segments in the search index"));
pub static INDEX_COMMIT_DURATION: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "vacancy_index_commit_duration_seconds",
        "Time to write and commit one batch of hotel documents",
        vec![0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0],
    )
});

/// Readers never wait for apply (`model::ReadModel::read` is one atomic
/// load); this shows it, with buckets fine enough to tell a pointer swap
/// from a lock wait.
pub static SEARCH_MODEL_WAIT: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "vacancy_search_model_wait_seconds",
        "Time a search waited to get at the copy (one per read of the copy)",
        vec![
            1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1,
        ],
    )
});

pub static SEARCH_RESULTS: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "vacancy_search_result_hotels",
        "Hotels matching one search (all pages)",
        vec![0.0, 1.0, 5.0, 20.0, 50.0, 100.0, 250.0, 1000.0],
    )
});

// --- owner reads -----------------------------------------------------------

pub static OWNER_READS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_owner_reads_total",
        "Direct reads of the owner database, by reason (few_units, min_lsn, bypass: rows for search; position: a confirmed read's WAL position; nudge: the logical message a confirmed read writes when the copy is slow to reach its position; ttl, audit; lag: a replica's poll of the owner's WAL position)",
        &["reason"],
    )
});
pub static OWNER_READ_ERRORS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_owner_read_errors_total",
        "Direct reads of the owner that failed or timed out, by reason",
        &["reason"],
    )
});
pub static NIGHTS_NOT_HELD: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_nights_not_held_total",
        "Owner inventory rows left out of the copy because their night is outside years 1900 to 2199 (an open-ended 9999-12-31, infinity, -infinity, BC, five-digit years): no guest can stay such a night. By where the row came in: snapshot, stream (each arrival, replays included), reread (the TTL re-read). Above 0, an owner row holds such a night",
        &["path"],
    )
});
pub static OWNER_TASK_ERRORS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_owner_task_errors_total",
        "Failed rounds of the background tasks that talk to the owner, by task (heartbeat: the logical message that keeps the lag honest and the slot moving on an idle owner; slot_watch: the slot's state and the owner's WAL positions)",
        &["task"],
    )
});
pub static OWNER_READ_DURATION: LazyLock<prometheus::HistogramVec> = LazyLock::new(|| {
    register(
        prometheus::HistogramVec::new(
            HistogramOpts::new(
                "vacancy_owner_read_duration_seconds",
                "Duration of one direct read of the owner, by reason",
            )
            .buckets(vec![
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
            ]),
            &["reason"],
        )
        .expect("valid metric"),
    )
});
pub static CONFIRMED_READS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_confirmed_reads_total",
        "Few-unit reads answered from the copy once it had applied an owner WAL position taken after the search began (search.fresh_reads = confirmed); the position reads themselves count in vacancy_owner_reads_total{reason=\"position\"}",
    )
});
pub static CONFIRMED_READ_WAIT: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "vacancy_confirmed_read_wait_seconds",
        "From the start of a confirmed read's owner position read to the copy having applied that position",
        vec![
            0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
        ],
    )
});
pub static CONFIRMED_READ_NUDGED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_confirmed_read_nudged_total",
        "Confirmed reads whose copy had not reached the owner position within 2 ms, so the node nudged the owner (a logical message; counted in vacancy_owner_reads_total{reason=\"nudge\"} when written) or, when it may not write, kept waiting for the stream",
    )
});
pub static CONFIRMED_READ_FALLBACKS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_confirmed_read_fallbacks_total",
        "Confirmed reads that fell back to reading the owner's rows, by cause (position_timeout, position_failed, apply_timeout, other_timeline, copy_behind; failed_before: an earlier round of the same search's page failed, so this one read rows at once)",
        &["cause"],
    )
});
pub static CACHE_REQUESTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_cache_requests_total",
        "Lookups in vacancy's caches (owner_read: search's owner reads), by result (hit, miss)",
        &["cache", "result"],
    )
});
pub static CACHE_EVICTIONS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_cache_evictions_total",
        "Entries leaving vacancy's caches (owner_read, ttl_confirmations), by moka's cause (expired, size, explicit, replaced)",
        &["cache", "cause"],
    )
});

/// moka's removal cause as a label value.
pub fn removal_cause(cause: moka::notification::RemovalCause) -> &'static str {
    use moka::notification::RemovalCause;
    match cause {
        RemovalCause::Expired => "expired",
        RemovalCause::Size => "size",
        RemovalCause::Explicit => "explicit",
        RemovalCause::Replaced => "replaced",
    }
}

// --- stale-read loop ---------------------------------------------------------

/// Entries in each bounded cache (attempt_ids, rate_limit_buckets,
/// search_candidates, owner_read), read at every scrape: with
/// `vacancy_cache_estimated_bytes`, what the process holds on purpose, so
/// a soak can tell it from a leak (`vacancy bench soak`).
pub static CACHE_ENTRIES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(
        IntGaugeVec::new(
            Opts::new(
                "vacancy_cache_entries",
                "Entries in each bounded cache (attempt_ids, rate_limit_buckets, search_candidates, owner_read)",
            ),
            &["cache"],
        )
        .expect("valid metric"),
    )
});

pub static CACHE_ESTIMATED_BYTES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(
        IntGaugeVec::new(
            Opts::new(
                "vacancy_cache_estimated_bytes",
                "Each bounded cache's entries times its entry size as estimated in the code (an estimate, not a measurement)",
            ),
            &["cache"],
        )
        .expect("valid metric"),
    )
});

/// What moka 0.12 spends per entry beside the key and the value: the hash
/// table's bucket and pointer slot, the `ValueEntry` with its `EntryInfo`
/// (key hash, generation, three timestamps, weight), the key's `Arc`, and
/// the nodes of the access-order and (with a TTL) write-order deques.
/// Measured, not derived: 40,000 and 500,000 `u64 -> u64` entries inserted
/// into a fresh `moka::sync::Cache` (max capacity 1,000,000, a time to
/// idle) raised the resident set by 259 to 263 bytes per entry (release
/// build, the binary's allocator: mimalloc 0.1.52 without transparent huge
/// pages; moka 0.12.16), of which 16 are the key and value.
pub const MOKA_ENTRY_OVERHEAD_BYTES: u64 = 245;
/// What a cache with a per-entry expiry (`expire_after`) adds to that: its
/// node in moka's timer wheel. Measured as the difference: 200,000 entries
/// shaped as the attempt ids (28-byte ids, `Arc` of a 72-byte entry, per-entry
/// expiry) cost 458 bytes each, where their parts and the overhead above
/// come to 421.
pub const MOKA_TIMER_ENTRY_BYTES: u64 = 37;

/// Tasks alive in the tokio runtime (spawned, not yet finished), read at
/// every scrape: a count that grows with uptime is a task leak.
pub static RUNTIME_ALIVE_TASKS: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_runtime_alive_tasks",
        "Tasks alive in the tokio runtime (spawned, not yet finished)",
    )
});

/// Sets one cache's two gauges.
pub fn set_cache_size(cache: &str, entries: u64, estimated_bytes: u64) {
    CACHE_ENTRIES
        .with_label_values(&[cache])
        .set(i64::try_from(entries).unwrap_or(i64::MAX));
    CACHE_ESTIMATED_BYTES
        .with_label_values(&[cache])
        .set(i64::try_from(estimated_bytes).unwrap_or(i64::MAX));
}

pub static TAKES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_takes_total",
        "Takes reported by the booking service, by outcome (taken, conflict, error) and by where the numbers the guest saw came from (copy, owner, copy_fallback, confirmed, none: no quote, or one older than stale.max_quote_age_secs)",
        &["outcome", "source"],
    )
});
pub static EXPIRED_QUOTES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_take_quotes_expired_total",
        "Takes reported with a quote shown longer ago than stale.max_quote_age_secs: counted as unquoted (source none), so a take made long after its search never counts against the copy",
    )
});
pub static CONFLICTS_AFTER_SHOWN: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_conflicts_after_shown_available_total",
        "409s after shown: takes refused by the owner (409) after the quote showed at least the units asked for, by where the numbers came from; source=\"copy\" and \"copy_fallback\" (the copy's unconfirmed numbers) are the stale reads",
        &["source"],
    )
});
pub static STALE_SHARE: LazyLock<prometheus::Gauge> = LazyLock::new(|| {
    float_gauge(
        "vacancy_stale_read_share_ratio",
        "The stale-read share: 409s after the copy showed at least the units asked for, per take the owner answered, over the sliding window (0 to 1; 409s after an owner read are not in it)",
    )
});
pub static CONFLICT_SHOW_LAG: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "vacancy_conflict_show_lag_seconds",
        "The copy's lag when it showed what turned into a conflict",
        vec![
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ],
    )
});
pub static BYPASS_ADVICE: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_bypass_advice_total",
        "Bypass advice given, by reason (few_units, lagging, not_ready, hotel_conflicts, diverging; none when the copy may be trusted)",
        &["reason"],
    )
});
pub static DIVERGENCE_CHECKED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_divergence_checked_total",
        "Rows the divergence audit compared with the owner",
    )
});
pub static DIVERGENCE_MISMATCHES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_divergence_mismatches_total",
        "Rows the copy showed differently from the owner although it was past the owner's read",
    )
});
pub static DIVERGENCE_LAST_PASS: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_divergence_last_pass_mismatches",
        "Mismatches found by the latest audit pass (0 once the copy is repaired)",
    )
});

// --- http -------------------------------------------------------------------

pub static HTTP_REQUESTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_http_requests_total",
        "HTTP requests by matched route and status",
        &["route", "status"],
    )
});
pub static HTTP_DURATION: LazyLock<HistogramVec> = LazyLock::new(|| {
    register(
        HistogramVec::new(
            HistogramOpts::new(
                "vacancy_http_request_duration_seconds",
                "HTTP request duration by route",
            )
            .buckets(vec![
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
            ]),
            &["route"],
        )
        .expect("valid metric"),
    )
});

pub static HTTP_IN_FLIGHT: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_http_requests_in_flight",
        "HTTP requests being answered now (at shutdown: those still draining)",
    )
});

/// Requests answered 503 `/problems/overloaded` by admission control
/// (`http::admission`), by budget (`guest`, `booking`).
pub static HTTP_SHED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_http_shed_total",
        "Requests answered 503 overloaded because their budget of requests in flight was full, by budget",
        &["budget"],
    )
});
/// How long a shed request took to answer, from its arrival in the router,
/// measured in the process: a load generator with thousands of connections
/// on the same cores mostly measures itself.
pub static HTTP_SHED_DURATION: LazyLock<HistogramVec> = LazyLock::new(|| {
    register(
        HistogramVec::new(
            HistogramOpts::new(
                "vacancy_http_shed_duration_seconds",
                "Time to answer a request shed by admission control, from its arrival in the router, by budget",
            )
            .buckets(vec![
                0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1,
            ]),
            &["budget"],
        )
        .expect("valid metric"),
    )
});

// --- checkpoints ------------------------------------------------------------

pub static CHECKPOINT_FALLBACKS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_checkpoint_fallbacks_total",
        "Starts that found a checkpoint but could not use it and took a full snapshot instead, by reason",
        &["reason"],
    )
});
pub static CHECKPOINT_LOADS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_checkpoint_loads_total",
        "Starts that loaded the copy from a checkpoint instead of a snapshot",
    )
});
pub static CHECKPOINT_WRITES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_checkpoint_writes_total",
        "Checkpoints written, by trigger (interval, snapshot, shutdown) and outcome (ok, error)",
        &["trigger", "outcome"],
    )
});
pub static FLEET_MESSAGES_PUBLISHED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_fleet_messages_published_total",
        "Change-stream messages the projector published and JetStream stored",
    )
});
pub static FLEET_PUBLISH_ERRORS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_fleet_publish_errors_total",
        "Publishing sessions that failed (NATS down, a refused publish); what was not stored is sent again",
    )
});
/// What the projector's publisher holds encoded (made and not yet stored
/// in JetStream), now and at most since the start: the bound the issue
/// asks of every role (`fleet::publish`), measured without RSS's noise.
pub static FLEET_PUBLISH_BUFFERED_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_fleet_publish_buffered_bytes",
        "Encoded change-stream messages the projector's publisher holds now: made, not yet stored in JetStream",
    )
});
pub static FLEET_PUBLISH_BUFFERED_BYTES_PEAK: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_fleet_publish_buffered_bytes_peak",
        "The most vacancy_fleet_publish_buffered_bytes has been since the process started",
    )
});
pub static FLEET_CHECKPOINT_UPLOADS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_fleet_checkpoint_uploads_total",
        "Checkpoints the projector uploaded to the object store, by outcome (ok, error, skipped: its sequence is of a change stream that is not there now)",
        &["outcome"],
    )
});
pub static FLEET_MESSAGES_APPLIED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_fleet_messages_applied_total",
        "Change-stream messages a replica applied (or held, for a chunk)",
    )
});
pub static FLEET_MESSAGES_DROPPED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_fleet_messages_dropped_total",
        "Change-stream messages a replica dropped: at or below its applied position, or of an older epoch",
    )
});
pub static FLEET_BOOTSTRAPS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_fleet_bootstraps_total",
        "Replica bootstraps from a checkpoint in the object store",
    )
});
pub static FLEET_OUTCOMES_PUBLISHED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_fleet_outcomes_published_total",
        "Take outcomes this node published to the fleet's outcome stream, by result (stored, duplicate: JetStream had one under the attempt id, error: not acknowledged)",
        &["result"],
    )
});
pub static FLEET_OUTCOMES_APPLIED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "vacancy_fleet_outcomes_applied_total",
        "Outcome-stream messages this node applied to its ledger, by result (new: counted, replay: the same report again, refused: another report under the id, invalid: not a valid report); every node applies every message, so do not sum over nodes",
        &["result"],
    )
});
pub static FLEET_OUTCOMES_MISSED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "vacancy_fleet_outcomes_missed_total",
        "Outcome-stream messages retention removed before this node read them (not counted here)",
    )
});
pub static CHECKPOINT_WRITE_DURATION: LazyLock<Histogram> = LazyLock::new(|| {
    histogram(
        "vacancy_checkpoint_write_seconds",
        "Time to write, fsync and rename one checkpoint",
        vec![0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0],
    )
});
pub static CHECKPOINT_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_checkpoint_bytes",
        "Size of the newest durable checkpoint",
    )
});
pub static CHECKPOINT_UNACKNOWLEDGED: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "vacancy_checkpoint_unacknowledged_bytes",
        "WAL the copy has applied but the slot is not yet told of, because no durable checkpoint covers it (a crash replays it)",
    )
});

pub static BUILD_INFO: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(
        IntGaugeVec::new(
            Opts::new("vacancy_build_info", "Build metadata; always 1"),
            &["version"],
        )
        .expect("valid metric"),
    )
});

/// Touches every metric so each appears in the first scrape, even before
/// its first event (dashboards and alert tests look for the names).
pub fn init() {
    BUILD_INFO
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
    STREAM_CONNECTED.set(0);
    LazyLock::force(&STREAM_SILENT_CATCH_UP);
    for op in ["upsert", "delete", "truncate"] {
        CHANGES_APPLIED.with_label_values(&[op]);
    }
    for reason in [
        "initial",
        "slot_missing",
        "slot_lost",
        "slot_ahead",
        "owner_changed",
    ] {
        RESNAPSHOTS.with_label_values(&[reason]);
    }
    LazyLock::force(&OWNER_CHANGES);
    LazyLock::force(&OWNER_CONNECTIONS_REFUSED);
    for table in ["hotels", "room_types", "inventory"] {
        MODEL_ENTRIES.with_label_values(&[table]);
    }
    LazyLock::force(&HTTP_IN_FLIGHT);
    LazyLock::force(&CHECKPOINT_FALLBACKS);
    LazyLock::force(&CHECKPOINT_LOADS);
    // stream::checkpoints::Trigger's labels (metrics cannot depend on
    // stream), so an alert on failed writes sees a series from the start.
    for trigger in ["interval", "snapshot", "shutdown"] {
        for outcome in ["ok", "error"] {
            CHECKPOINT_WRITES.with_label_values(&[trigger, outcome]);
        }
    }
    LazyLock::force(&CHECKPOINT_WRITE_DURATION);
    LazyLock::force(&CHECKPOINT_BYTES);
    LazyLock::force(&FLEET_MESSAGES_PUBLISHED);
    LazyLock::force(&FLEET_PUBLISH_ERRORS);
    LazyLock::force(&FLEET_PUBLISH_BUFFERED_BYTES);
    LazyLock::force(&FLEET_PUBLISH_BUFFERED_BYTES_PEAK);
    LazyLock::force(&FLEET_CHECKPOINT_UPLOADS);
    LazyLock::force(&FLEET_MESSAGES_APPLIED);
    LazyLock::force(&FLEET_MESSAGES_DROPPED);
    LazyLock::force(&FLEET_BOOTSTRAPS);
    for result in ["stored", "duplicate", "error"] {
        FLEET_OUTCOMES_PUBLISHED.with_label_values(&[result]);
    }
    for result in ["new", "replay", "refused", "invalid"] {
        FLEET_OUTCOMES_APPLIED.with_label_values(&[result]);
    }
    LazyLock::force(&FLEET_OUTCOMES_MISSED);
    LazyLock::force(&CHECKPOINT_UNACKNOWLEDGED);
    LazyLock::force(&TRANSACTIONS_APPLIED);
    LazyLock::force(&TRANSACTIONS_SKIPPED);
    LazyLock::force(&APPLY_DURATION);
    LazyLock::force(&LAG_BYTES);
    LazyLock::force(&LAG_SECONDS);
    LazyLock::force(&SECONDS_SINCE_LAST_MESSAGE);
    LazyLock::force(&RECONNECTS);
    LazyLock::force(&SNAPSHOT_ROWS);
    LazyLock::force(&SNAPSHOT_PROGRESS);
    LazyLock::force(&BUFFERED_CHANGES);
    LazyLock::force(&HELD_SPILLED_TRANSACTIONS);
    LazyLock::force(&HELD_SPILLED_BYTES);
    LazyLock::force(&SLOT_RETAINED_WAL);
    LazyLock::force(&SLOT_ACTIVE);
    LazyLock::force(&READY);
    LazyLock::force(&MODEL_BYTES);
    LazyLock::force(&TTL_ROWS_REREAD);
    LazyLock::force(&TTL_ROWS_REPAIRED);
    LazyLock::force(&TTL_DUE);
    LazyLock::force(&TTL_READS_DEFERRED);
    LazyLock::force(&OWNER_READ_DURATION);
    LazyLock::force(&INDEX_DOCUMENTS);
    LazyLock::force(&SEARCH_RESULTS);
    for result in ["hit", "miss"] {
        CACHE_REQUESTS.with_label_values(&["owner_read", result]);
    }
    for cache in ["owner_read", "ttl_confirmations"] {
        for cause in ["expired", "size", "explicit", "replaced"] {
            CACHE_EVICTIONS.with_label_values(&[cache, cause]);
        }
    }
    for cache in [
        "attempt_ids",
        "rate_limit_buckets",
        "search_candidates",
        "owner_read",
    ] {
        set_cache_size(cache, 0, 0);
    }
    LazyLock::force(&RUNTIME_ALIVE_TASKS);
    LazyLock::force(&CONFIRMED_READS);
    LazyLock::force(&CONFIRMED_READ_WAIT);
    LazyLock::force(&CONFIRMED_READ_NUDGED);
    for cause in [
        "position_timeout",
        "position_failed",
        "apply_timeout",
        "other_timeline",
        "copy_behind",
        "failed_before",
    ] {
        CONFIRMED_READ_FALLBACKS.with_label_values(&[cause]);
    }
    for reason in ["few_units", "min_lsn", "bypass", "position", "nudge", "lag"] {
        OWNER_READS.with_label_values(&[reason]);
        OWNER_READ_ERRORS.with_label_values(&[reason]);
        OWNER_READ_DURATION.with_label_values(&[reason]);
    }
    LazyLock::force(&INDEX_SEGMENTS);
    LazyLock::force(&INDEX_COMMIT_DURATION);
    OWNER_READS.with_label_values(&["ttl"]);
    OWNER_READ_ERRORS.with_label_values(&["ttl"]);
    for task in ["heartbeat", "slot_watch"] {
        OWNER_TASK_ERRORS.with_label_values(&[task]);
    }
    for path in ["snapshot", "stream", "reread"] {
        NIGHTS_NOT_HELD.with_label_values(&[path]);
    }
    LazyLock::force(&HTTP_REQUESTS);
    LazyLock::force(&HTTP_DURATION);
    // http::admission::Budget's names (metrics cannot depend on http).
    for budget in ["guest", "booking"] {
        HTTP_SHED.with_label_values(&[budget]);
        HTTP_SHED_DURATION.with_label_values(&[budget]);
    }
    OWNER_READS.with_label_values(&["audit"]);
    OWNER_READ_ERRORS.with_label_values(&["audit"]);
    for outcome in ["taken", "conflict", "error"] {
        for source in ["copy", "owner", "copy_fallback", "confirmed", "none"] {
            TAKES.with_label_values(&[outcome, source]);
        }
    }
    for source in ["copy", "owner", "copy_fallback", "confirmed", "none"] {
        CONFLICTS_AFTER_SHOWN.with_label_values(&[source]);
    }
    for reason in [
        "few_units",
        "lagging",
        "not_ready",
        "hotel_conflicts",
        "diverging",
        "none",
    ] {
        BYPASS_ADVICE.with_label_values(&[reason]);
    }
    LazyLock::force(&STALE_SHARE);
    LazyLock::force(&EXPIRED_QUOTES);
    LazyLock::force(&CONFLICT_SHOW_LAG);
    LazyLock::force(&DIVERGENCE_CHECKED);
    LazyLock::force(&DIVERGENCE_MISMATCHES);
    LazyLock::force(&DIVERGENCE_LAST_PASS);
}

/// The text exposition of everything registered.
pub fn render() -> String {
    let mut out = Vec::new();
    let families = REGISTRY.gather();
    // Encoding into a Vec cannot fail on I/O; a failure here is a bug in a metric.
    TextEncoder::new()
        .encode(&families, &mut out)
        .expect("encode metrics");
    String::from_utf8(out).unwrap_or_default()
}
