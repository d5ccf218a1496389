"""Generates dashboards/*.json: python3 dashboards/generate.py dashboards (edit here, then regenerate)."""
import json, sys

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance"'

def sel(extra=""):
    return "{" + SEL + ((", " + extra) if extra else "") + "}"

RI = "[$__rate_interval]"
# The stale reads: 409s after the copy's unconfirmed numbers (copy, and
# copy_fallback when the owner did not answer in time), per take the owner
# answered (taken or conflict; errors are not answers): the API's share.
SEL_COPY = sel('source=~"copy|copy_fallback"')
SEL_ANSWERED = sel('outcome=~"taken|conflict"')
SEL_5XX = sel('status=~"5.."')

def templating():
    return {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "regex": "", "includeAll": False, "multi": False},
        {"name": "job", "label": "Job", "type": "query", "datasource": DS,
         "definition": "label_values(vacancy_build_info, job)",
         "query": {"query": "label_values(vacancy_build_info, job)", "refId": "job"},
         "current": {}, "hide": 0, "refresh": 2, "regex": "", "sort": 1,
         "includeAll": True, "multi": True, "allValue": ".*"},
        {"name": "instance", "label": "Instance", "type": "query", "datasource": DS,
         "definition": 'label_values(vacancy_build_info{job=~"$job"}, instance)',
         "query": {"query": 'label_values(vacancy_build_info{job=~"$job"}, instance)', "refId": "instance"},
         "current": {}, "hide": 0, "refresh": 2, "regex": "", "sort": 1,
         "includeAll": True, "multi": True, "allValue": ".*"},
    ]}

class Board:
    def __init__(self):
        self.panels = []
        self.y = 0
        self.x = 0
        self.row_h = 0
        self.next_id = 1

    def row(self, title):
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0
        self.panels.append({"id": self.next_id, "type": "row", "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.next_id += 1
        self.y += 1

    def add(self, kind, title, desc, unit, targets, w=12, h=8, thresholds=None, extra_defaults=None,
            options=None, custom=None, min_=None, max_=None, decimals=None, overrides=None):
        if self.x + w > 24:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0
        defaults = {"unit": unit}
        if min_ is not None: defaults["min"] = min_
        if max_ is not None: defaults["max"] = max_
        if decimals is not None: defaults["decimals"] = decimals
        steps = [{"color": "green", "value": None}]
        for v, c in (thresholds or []):
            steps.append({"color": c, "value": v})
        defaults["thresholds"] = {"mode": "absolute", "steps": steps}
        if kind == "timeseries":
            c = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                 "spanNulls": False, "axisSoftMin": 0,
                 "thresholdsStyle": {"mode": "line" if thresholds else "off"}}
            c.update(custom or {})
            defaults["custom"] = c
            defaults["color"] = {"mode": "palette-classic"}
        else:
            defaults["color"] = {"mode": "thresholds"}
        if extra_defaults:
            defaults.update(extra_defaults)
        ts = []
        for i, t in enumerate(targets):
            expr, legend = t[0], t[1]
            tgt = {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr,
                   "legendFormat": legend, "range": True, "instant": False}
            if len(t) > 2: tgt.update(t[2])
            ts.append(tgt)
        p = {"id": self.next_id, "type": kind, "title": title, "description": desc,
             "datasource": DS, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
             "targets": ts, "fieldConfig": {"defaults": defaults, "overrides": overrides or []}}
        if kind == "timeseries":
            p["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}}
        else:
            p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                            "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto",
                            "orientation": "auto"}
        if options: p["options"].update(options)
        self.panels.append(p)
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)

    def dashboard(self, uid, title, desc, tags, links):
        return {
            "uid": uid, "title": title, "description": desc, "tags": tags,
            "id": None, "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
            "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "timezone": "utc",
            "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
            "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                      "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                      "name": "Annotations & Alerts", "type": "dashboard"}]},
            "links": links,
            "templating": templating(),
            "panels": self.panels,
        }

def hq(q, metric, by=""):
    b = "le" + ((", " + by) if by else "")
    return f"histogram_quantile({q}, sum by ({b}) (rate({metric}_bucket{sel()}{RI})))"

# ---------------------------------------------------------------------------
def stale():
    b = Board()
    share = (f'sum(rate(vacancy_conflicts_after_shown_available_total{SEL_COPY}{RI}))'
             f'\n  /\nsum(rate(vacancy_takes_total{SEL_ANSWERED}{RI}))')
    b.row("Stale reads: 409s after the copy showed the room free")
    b.add("stat", "Stale-read share (service window)",
          "The stale-read share: takes that ended in a 409 conflict after the copy showed the room available (stale reads), per take the owner answered, over the service's own sliding window (vacancy_stale_read_share_ratio, highest instance). Objective: at most 0.001 (the copy adds at most 0.1 percentage points); red above it.",
          "percentunit", [(f"max(vacancy_stale_read_share_ratio{sel()})", "share")],
          w=6, thresholds=[(0.001, "red")], decimals=3)
    b.add("timeseries", "Stale-read share vs objective",
          "Stale reads (conflicts on takes whose room the copy showed available) divided by all takes, from the counters (per scrape interval) and from the service's sliding window. The dashed 'objective' series and the red threshold line mark 0.001 (0.1 percentage points). Alert: VacancyStaleReadShareAboveObjective.",
          "percentunit",
          [(share, "share (counters)"),
           (f"max(vacancy_stale_read_share_ratio{sel()})", "share (service window)"),
           ("vector(0.001)", "objective (0.1 pp)")],
          w=18, thresholds=[(0.001, "red")], decimals=3,
          overrides=[{"matcher": {"id": "byName", "options": "objective (0.1 pp)"},
                      "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
                                     {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                                     {"id": "custom.fillOpacity", "value": 0}]}])
    b.add("timeseries", "409s after shown, by source",
          "409s after shown: takes refused with 409 although the answer showed the room free, per second, by where the shown numbers came from: copy (the read copy; these and copy_fallback are the stale reads), owner (read from the owner while answering: guests racing each other), copy_fallback (owner read timed out; copy shown, flagged), confirmed (the copy once past an owner position taken after the search began: guests racing each other, as with owner), none (take without a quote token).",
          "ops", [(f"sum by (source) (rate(vacancy_conflicts_after_shown_available_total{sel()}{RI}))", "{{source}}")],
          w=12)
    b.add("timeseries", "Takes by outcome and source",
          "Take outcomes reported by the booking service (POST /v1/take-outcomes) per second: outcome taken, conflict (409) or error, by the source of the numbers the guest was shown. The denominator of the share.",
          "ops", [(f"sum by (outcome, source) (rate(vacancy_takes_total{sel()}{RI}))", "{{outcome}} / {{source}}")],
          w=12, custom={"stacking": {"mode": "normal", "group": "A"}})
    b.row("Why: lag at show time and bypass advice")
    b.add("timeseries", "Copy lag at show time of conflicts",
          "How far the copy lagged behind the owner at the moment it showed what later became a 409 conflict (quantiles of vacancy_conflict_show_lag_seconds). High values point at lag; low values at guests racing each other or too few units.",
          "s",
          [(hq(0.5, "vacancy_conflict_show_lag_seconds"), "p50"),
           (hq(0.9, "vacancy_conflict_show_lag_seconds"), "p90"),
           (hq(0.99, "vacancy_conflict_show_lag_seconds"), "p99")], w=12)
    b.add("timeseries", "Bypass advice by reason",
          "GET /v1/bypass answers per second, by reason: few_units, lagging, not_ready, hotel_conflicts (bypass the copy and read the owner), none (the copy may be trusted). A rise in lagging or not_ready moves load onto the owner.",
          "ops", [(f"sum by (reason) (rate(vacancy_bypass_advice_total{sel()}{RI}))", "{{reason}}")],
          w=12, custom={"stacking": {"mode": "normal", "group": "A"}})
    b.row("Freshness of the copy")
    b.add("timeseries", "Apply lag (seconds)",
          "How far behind the owner the copy is in time (vacancy_stream_lag_seconds), per instance, and seconds since the stream last delivered a message (the heartbeat keeps it near the heartbeat interval). Lines: 5 s (not ready, VacancyStreamLagHigh), 10 s (searches refused, VacancyStreamLagCritical).",
          "s",
          [(f"max by (instance) (vacancy_stream_lag_seconds{sel()})", "lag {{instance}}"),
           (f"max by (instance) (vacancy_stream_seconds_since_last_message{sel()})", "since last message {{instance}}")],
          w=12, thresholds=[(5, "orange"), (10, "red")])
    b.add("timeseries", "Apply lag (bytes)",
          "WAL bytes between the owner's position and what the copy has applied (vacancy_stream_lag_bytes), per instance. Grows with owner write volume while the copy is behind; compare with the lag in seconds.",
          "bytes",
          [(f"max by (instance) (vacancy_stream_lag_bytes{sel()})", "lag {{instance}}")], w=12)
    b.add("timeseries", "Slot retained WAL",
          "WAL the owner keeps for vacancy's replication slot, from pg_replication_slots (vacancy_slot_retained_wal_bytes). The red line is the VacancySlotRetainingTooMuchWAL threshold (5 GiB).",
          "bytes", [(f"max by (instance) (vacancy_slot_retained_wal_bytes{sel()})", "{{instance}}")],
          w=12, thresholds=[(5 * 1024 ** 3, "red")])
    b.add("stat", "Slot active",
          "Whether the replication slot has an active walsender (vacancy_slot_active), lowest instance. An inactive slot still retains WAL (VacancySlotInactive).",
          "bool_yes_no", [(f"min(vacancy_slot_active{sel()})", "active")], w=6,
          extra_defaults={"mappings": []}, thresholds=None)
    b.add("stat", "Stream connected",
          "Whether the replication connection is streaming (vacancy_stream_connected), lowest instance (VacancyStreamDisconnected).",
          "bool_yes_no", [(f"min(vacancy_stream_connected{sel()})", "connected")], w=6)
    b.row("Divergence and the TTL safety net")
    b.add("timeseries", "Divergence audit",
          "Keys the background audit compared with the owner at the same LSN, and mismatches found, per second. On a healthy stream mismatches stay 0 (VacancyCopyDiverges).",
          "ops",
          [(f"sum(rate(vacancy_divergence_checked_total{sel()}{RI}))", "checked"),
           (f"sum(rate(vacancy_divergence_mismatches_total{sel()}{RI}))", "mismatches")], w=12)
    b.add("timeseries", "TTL repairs",
          "Nights a TTL re-read found different in the copy (a change the stream did not deliver), per second. Should stay 0; compare with the divergence audit.",
          "ops", [(f"sum(rate(vacancy_ttl_rows_repaired_total{sel()}{RI}))", "repaired nights")], w=12)
    return b.dashboard("vacancy-stale-reads", "vacancy: stale reads and freshness",
                       "How often what the copy shows turns into a 409, why, and how fresh the copy is.",
                       ["vacancy"],
                       [{"title": "Service health", "type": "link", "url": "/d/vacancy-service-health",
                         "keepTime": True, "includeVars": True}])

# ---------------------------------------------------------------------------
def health():
    b = Board()
    req = f"vacancy_http_requests_total{sel()}"
    req5 = f'vacancy_http_requests_total{SEL_5XX}'
    b.row("HTTP: rate, errors, duration per route")
    b.add("timeseries", "Request rate by route",
          "HTTP requests per second by matched route (unmatched paths are counted as 'unmatched').",
          "reqps", [(f"sum by (route) (rate({req}{RI}))", "{{route}}")], w=8)
    b.add("timeseries", "Error ratio (5xx) by route",
          "Share of requests answered with a 5xx status, by route: 503 not ready, lagging past search.max_lag_ms, shed by admission control (overloaded), or timed out. 4xx (bad parameters, unknown hotel) are client errors and not counted here.",
          "percentunit",
          [(f"(\n  sum by (route) (rate({req5}{RI}))\n    or\n  sum by (route) (rate({req}{RI})) * 0\n)\n  /\nsum by (route) (rate({req}{RI}))", "{{route}}")],
          w=8, thresholds=[(0.01, "red")], min_=0)
    b.add("timeseries", "p99 duration by route",
          "99th percentile of request duration per route (vacancy_http_request_duration_seconds).",
          "s", [(hq(0.99, "vacancy_http_request_duration_seconds", "route"), "{{route}}")], w=8)
    b.add("timeseries", "Responses by status",
          "HTTP responses per second by status code, all routes.",
          "reqps", [(f"sum by (status) (rate({req}{RI}))", "{{status}}")], w=8,
          custom={"stacking": {"mode": "normal", "group": "A"}})
    b.add("timeseries", "p50 duration by route",
          "Median request duration per route.",
          "s", [(hq(0.5, "vacancy_http_request_duration_seconds", "route"), "{{route}}")], w=8)
    b.add("timeseries", "Search result size",
          "Hotels matching one search (all pages), median and 99th percentile (vacancy_search_result_hotels).",
          "short",
          [(hq(0.5, "vacancy_search_result_hotels"), "p50"),
           (hq(0.99, "vacancy_search_result_hotels"), "p99")], w=8)
    b.add("timeseries", "Requests shed by budget",
          "Requests answered 503 /problems/overloaded at once because their budget of requests in flight was full (vacancy_http_shed_total): guest (http.max_guest_requests_in_flight), booking (http.max_booking_requests_in_flight). Sustained guest sheds mean the fleet needs more nodes; booking sheds mean the booking service sends more than its budget.",
          "reqps", [(f"sum by (budget) (rate(vacancy_http_shed_total{sel()}{RI}))", "{{budget}}")], w=8)
    b.add("timeseries", "Time to shed, p99",
          "99th percentile of the time a shed request took to answer, from its arrival in the router (vacancy_http_shed_duration_seconds), measured in the process: a 503 should leave in well under 5 ms.",
          "s", [(hq(0.99, "vacancy_http_shed_duration_seconds", "budget"), "{{budget}}")], w=8)
    b.row("Read model, caches and index")
    b.add("timeseries", "Read model entries by table",
          "Hotels, room types and inventory rows (one per room type and night) held in the copy.",
          "short", [(f"max by (table) (vacancy_model_entries{sel()})", "{{table}}")], w=8)
    b.add("timeseries", "Memory",
          "Bytes of packed nightly counts held by the read model, and the process's resident memory.",
          "bytes",
          [(f"max by (instance) (vacancy_model_inventory_bytes{sel()})", "inventory {{instance}}"),
           (f"max by (instance) (process_resident_memory_bytes{sel()})", "resident {{instance}}")], w=8)
    b.add("timeseries", "CPU",
          "CPU seconds used per second by the process (1 = one core busy).",
          "short", [(f"sum by (instance) (rate(process_cpu_seconds_total{sel()}{RI}))", "{{instance}}")], w=8)
    b.add("timeseries", "Search wait for the copy",
          "Time a search waited to get at the read model, 99.9th percentile and maximum bucket (vacancy_search_model_wait_seconds). Reading the copy is one atomic load, so this stays in microseconds even while a large transaction applies; a rise means the process is starved of CPU, not blocked by apply.",
          "s",
          [(hq(0.999, "vacancy_search_model_wait_seconds"), "p99.9"),
           (hq(1.0, "vacancy_search_model_wait_seconds"), "max")], w=8)
    b.add("timeseries", "Index documents and segments",
          "Hotel documents in the tantivy search index and the index's segment count.",
          "short",
          [(f"max by (instance) (vacancy_index_documents{sel()})", "documents {{instance}}"),
           (f"max by (instance) (vacancy_index_segments{sel()})", "segments {{instance}}")], w=8)
    b.add("timeseries", "Index commit duration",
          "Time to write and commit one batch of hotel documents, median and 99th percentile.",
          "s",
          [(hq(0.5, "vacancy_index_commit_duration_seconds"), "p50"),
           (hq(0.99, "vacancy_index_commit_duration_seconds"), "p99")], w=8)
    b.add("timeseries", "TTL re-reads",
          "The TTL safety net: inventory rows re-read from the owner because their calendar's TTL ran out, nights such a re-read found different, and re-reads given up because the owner still hid a commit the copy had applied (synchronous replication waiting on a standby), per second.",
          "ops",
          [(f"sum(rate(vacancy_ttl_rows_reread_total{sel()}{RI}))", "rows re-read"),
           (f"sum(rate(vacancy_ttl_rows_repaired_total{sel()}{RI}))", "nights repaired"),
           (f"sum(rate(vacancy_ttl_reads_deferred_total{sel()}{RI}))", "re-reads deferred")], w=8)
    b.add("timeseries", "TTL calendars due",
          "Calendars whose TTL ran out and wait for a re-read. Growing means the refresher cannot keep up (owner slow or model.refresh_batch too small).",
          "short", [(f"max by (instance) (vacancy_ttl_due_calendars{sel()})", "{{instance}}")], w=8)
    b.row("Owner reads")
    b.add("timeseries", "Owner reads by reason",
          "Direct reads of the owner database per second, by reason: few_units (search shows few units), min_lsn (copy behind a caller's LSN), bypass, ttl (safety-net re-reads), audit (divergence audit).",
          "ops", [(f"sum by (reason) (rate(vacancy_owner_reads_total{sel()}{RI}))", "{{reason}}")], w=8,
          custom={"stacking": {"mode": "normal", "group": "A"}})
    b.add("timeseries", "Owner read errors by reason",
          "Owner reads that failed or timed out per second, by reason. A failed few-unit read answers with the copy's numbers (source copy_fallback). Alert: VacancyOwnerReadsFailing (over 5 %).",
          "ops", [(f"sum by (reason) (rate(vacancy_owner_read_errors_total{sel()}{RI}))", "{{reason}}")], w=8)
    b.add("timeseries", "Owner read latency by reason",
          "Duration of one direct owner read (one query actually sent), 99th percentile by reason.",
          "s",
          [(hq(0.99, "vacancy_owner_read_duration_seconds", "reason"), "p99 {{reason}}")], w=8)
    b.add("timeseries", "Owner-read cache hit ratio",
          "Share of search owner reads answered by the coalescing cache (identical reads within search.owner_read_cache_ms share one query).",
          "percentunit",
          [("sum(rate(vacancy_cache_requests_total" + sel('cache="owner_read", result="hit"') + RI + ")) / sum(rate(vacancy_cache_requests_total" + sel('cache="owner_read"') + RI + "))", "hit ratio")],
          w=12, min_=0, max_=1)
    b.add("timeseries", "Cache evictions by cause",
          "Entries leaving vacancy's moka caches per second, by cache and cause. ttl_confirmations expiring is the TTL safety net queueing a calendar for a re-read; owner_read expiring is the coalescing window closing.",
          "ops",
          [(f"sum by (cache, cause) (rate(vacancy_cache_evictions_total{sel()}{RI}))", "{{cache}} {{cause}}")], w=12)
    b.row("Stream and snapshots")
    b.add("stat", "Snapshot progress",
          "Progress of the current snapshot load, 0 to 100 % (lowest instance). Below 100 % the instance is not ready.",
          "percentunit", [(f"min(vacancy_snapshot_progress_ratio{sel()})", "progress")], w=6, min_=0, max_=1,
          thresholds=None)
    b.add("timeseries", "Snapshot rows loaded",
          "Rows read from snapshots per second (initial load and resnapshots).",
          "ops", [(f"sum by (instance) (rate(vacancy_snapshot_rows_loaded_total{sel()}{RI}))", "{{instance}}")], w=6)
    b.add("timeseries", "Reconnects and resnapshots",
          "Replication sessions that ended in an error and were retried, and copies rebuilt from a new snapshot by reason, per interval. Resnapshots other than 'initial' mean the slot went missing or was lost.",
          "short",
          [(f"sum by (instance) (increase(vacancy_stream_reconnects_total{sel()}{RI}))", "reconnects {{instance}}"),
           (f"sum by (reason) (increase(vacancy_resnapshots_total{sel()}{RI}))", "resnapshot {{reason}}")], w=12,
          custom={"drawStyle": "bars", "fillOpacity": 80})
    b.add("timeseries", "Changes and transactions applied",
          "Owner transactions applied to the copy and row changes by operation, per second; and transactions delivered again after a reconnect and skipped.",
          "ops",
          [(f"sum by (op) (rate(vacancy_stream_changes_applied_total{sel()}{RI}))", "changes {{op}}"),
           (f"sum(rate(vacancy_stream_transactions_applied_total{sel()}{RI}))", "transactions"),
           (f"sum(rate(vacancy_stream_transactions_skipped_total{sel()}{RI}))", "transactions skipped")], w=12)
    b.add("timeseries", "Apply duration",
          "Time to apply one owner transaction to the copy under the write lock, median and 99th percentile.",
          "s",
          [(hq(0.5, "vacancy_stream_apply_duration_seconds"), "p50"),
           (hq(0.99, "vacancy_stream_apply_duration_seconds"), "p99")], w=6)
    b.add("timeseries", "Buffered changes",
          "Row changes held for owner transactions that have not committed yet (large or streamed transactions).",
          "short", [(f"max by (instance) (vacancy_stream_buffered_changes{sel()})", "{{instance}}")], w=6)
    b.add("stat", "Version",
          "The running build (vacancy_build_info), one entry per version.",
          "none", [(f"count by (version) (vacancy_build_info{sel()})", "{{version}}")], w=6,
          options={"textMode": "name", "graphMode": "none"})
    return b.dashboard("vacancy-service-health", "vacancy: service health",
                       "RED per route, the read model, caches and index, owner reads, the stream and snapshots.",
                       ["vacancy"],
                       [{"title": "Stale reads and freshness", "type": "link", "url": "/d/vacancy-stale-reads",
                         "keepTime": True, "includeVars": True}])

out = sys.argv[1]
for name, d in [("stale-reads-and-freshness.json", stale()), ("service-health.json", health())]:
    with open(f"{out}/{name}", "w") as f:
        json.dump(d, f, indent=2, ensure_ascii=False)
        f.write("\n")
