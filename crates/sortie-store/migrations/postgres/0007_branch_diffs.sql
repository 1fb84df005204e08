-- A session's branch against the commit it started from, as the host read it from trusted objects at the
-- session's last delivery (GET /v1/sessions/{id}/diff): one row a session, replaced at every delivery.
-- The body is the JSON of sortie_protocol::api::StoredDiff, capped (3,000 files, 2 MiB of patches).
CREATE TABLE branch_diffs (
    session_id TEXT PRIMARY KEY,
    head_sha   TEXT NOT NULL,
    body       TEXT NOT NULL,
    updated_at BIGINT NOT NULL
);
