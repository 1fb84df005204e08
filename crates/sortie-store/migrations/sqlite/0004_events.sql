-- Control-plane events (DESIGN §14): every change of a session's phase or a turn's status, written in
-- the transaction that makes the change, numbered in commit order. `GET /v1/events` reads them after
-- a client's Last-Event-ID; webhook deliveries are made from them. Kept for a retention window.
CREATE TABLE events (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    workspace_id   TEXT NOT NULL,
    session_id     TEXT NOT NULL,
    turn           INTEGER,
    kind           TEXT NOT NULL,
    state          TEXT NOT NULL,
    failure_code   TEXT,
    failure_reason TEXT,
    at             INTEGER NOT NULL
);
CREATE INDEX events_workspace_seq ON events (workspace_id, seq);
CREATE INDEX events_at ON events (at);

-- The newest event number pruned: a reader asking for events after an older one has lost some.
CREATE TABLE event_horizon (
    id             INTEGER PRIMARY KEY CHECK (id = 1),
    pruned_through INTEGER NOT NULL
);
INSERT INTO event_horizon (id, pruned_through) VALUES (1, 0);
