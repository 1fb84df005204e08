-- sortie's schema (DESIGN §8). Ids are TEXT, times are INTEGER epoch milliseconds, booleans are 0/1,
-- payloads are TEXT kept verbatim. Append-only: change the schema with a new migration.

CREATE TABLE workspaces (
    id              TEXT PRIMARY KEY,
    name            TEXT NOT NULL UNIQUE,
    allow_any_local INTEGER NOT NULL DEFAULT 0,
    allowed_roots   TEXT NOT NULL DEFAULT '[]',
    created_at      INTEGER NOT NULL
);

CREATE TABLE tokens (
    id           TEXT PRIMARY KEY,
    workspace_id TEXT NOT NULL REFERENCES workspaces (id),
    role         TEXT NOT NULL,
    token_hash   TEXT NOT NULL UNIQUE,
    label        TEXT,
    created_at   INTEGER NOT NULL,
    revoked_at   INTEGER
);

CREATE TABLE sessions (
    id               TEXT PRIMARY KEY,
    workspace_id     TEXT NOT NULL REFERENCES workspaces (id),
    repo             TEXT NOT NULL,
    base             TEXT,
    agent            TEXT NOT NULL,
    model            TEXT,
    title            TEXT NOT NULL,
    phase            TEXT NOT NULL,
    queued_reason    TEXT,
    n_turns          INTEGER NOT NULL,
    n_waiting        INTEGER NOT NULL,
    current_turn     INTEGER,
    head_sha         TEXT,
    pr_url           TEXT,
    pr_number        INTEGER,
    failure_code     TEXT,
    failure_reason   TEXT,
    egress_allow     TEXT NOT NULL,
    setup            TEXT,
    archived         INTEGER NOT NULL DEFAULT 0,
    resume_requested INTEGER NOT NULL DEFAULT 0,
    prompts_bytes    INTEGER NOT NULL,
    next_part_seq    INTEGER NOT NULL DEFAULT 0,
    compute_ms       INTEGER NOT NULL DEFAULT 0,
    input_tokens     INTEGER NOT NULL DEFAULT 0,
    output_tokens    INTEGER NOT NULL DEFAULT 0,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL
);
CREATE INDEX sessions_by_workspace ON sessions (workspace_id, archived, id);
CREATE INDEX sessions_by_phase ON sessions (phase);

CREATE TABLE turns (
    session_id     TEXT NOT NULL REFERENCES sessions (id),
    n              INTEGER NOT NULL,
    prompt         TEXT NOT NULL,
    status         TEXT NOT NULL,
    mode           TEXT NOT NULL,
    stop_requested TEXT,
    priming        TEXT,
    baseline_sha   TEXT,
    head_sha       TEXT,
    failure_code   TEXT,
    failure_reason TEXT,
    claimed_by     TEXT,
    created_at     INTEGER NOT NULL,
    started_at     INTEGER,
    completed_at   INTEGER,
    PRIMARY KEY (session_id, n)
);
CREATE INDEX turns_by_status ON turns (status, created_at);

CREATE TABLE parts (
    session_id TEXT NOT NULL REFERENCES sessions (id),
    turn       INTEGER NOT NULL,
    part_index INTEGER NOT NULL,
    seq        INTEGER NOT NULL,
    payload    TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (session_id, turn, part_index)
);
CREATE UNIQUE INDEX parts_by_seq ON parts (session_id, seq);

CREATE TABLE ticket_nonces (
    nonce      TEXT PRIMARY KEY,
    expires_at INTEGER NOT NULL
);

CREATE TABLE usage_tokens (
    session_id    TEXT NOT NULL REFERENCES sessions (id),
    turn          INTEGER NOT NULL,
    model         TEXT NOT NULL,
    day           TEXT NOT NULL,
    input_tokens  INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    requests      INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, turn, model, day)
);

CREATE TABLE usage_compute (
    session_id        TEXT NOT NULL REFERENCES sessions (id),
    turn              INTEGER NOT NULL,
    day               TEXT NOT NULL,
    compute_ms        INTEGER NOT NULL DEFAULT 0,
    peak_memory_bytes INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, turn, day)
);

CREATE TABLE model_keys (
    workspace_id   TEXT NOT NULL REFERENCES workspaces (id),
    api            TEXT NOT NULL,
    key_ciphertext TEXT NOT NULL,
    key_nonce      TEXT NOT NULL,
    label          TEXT,
    created_at     INTEGER NOT NULL,
    PRIMARY KEY (workspace_id, api)
);

CREATE TABLE forge_connections (
    workspace_id     TEXT NOT NULL REFERENCES workspaces (id),
    host             TEXT NOT NULL,
    kind             TEXT NOT NULL,
    api_base         TEXT NOT NULL,
    token_ciphertext TEXT NOT NULL,
    token_nonce      TEXT NOT NULL,
    created_at       INTEGER NOT NULL,
    PRIMARY KEY (workspace_id, host)
);

CREATE TABLE sandboxes (
    session_id        TEXT PRIMARY KEY REFERENCES sessions (id),
    backend           TEXT NOT NULL,
    handle            TEXT NOT NULL,
    state             TEXT NOT NULL,
    worker_id         TEXT,
    cpu_ms            INTEGER NOT NULL DEFAULT 0,
    peak_memory_bytes INTEGER NOT NULL DEFAULT 0,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL
);

CREATE TABLE instance_secrets (
    name       TEXT PRIMARY KEY,
    value      TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
