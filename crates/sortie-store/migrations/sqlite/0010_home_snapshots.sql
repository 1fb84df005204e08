-- What a session's agent kept in its home (its own sessions, which `session/load` reads), as a tar the
-- session's pod gave up at hibernation, for the next pod of the same session: base64, capped by the worker
-- (sortie_protocol::driver::HOME_SNAPSHOT_MAX_BYTES). Only that session's pods ever receive it back.
CREATE TABLE home_snapshots (
    session_id TEXT PRIMARY KEY,
    body       TEXT NOT NULL,
    bytes      INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
