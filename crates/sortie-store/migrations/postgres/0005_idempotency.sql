-- Idempotency-Key (DESIGN §14): the first answer to a create or a steer under a key, per workspace,
-- returned again for a retry of the same request for 24 h. A row without a status is a request still
-- being answered.
CREATE TABLE idempotency_keys (
    workspace_id TEXT NOT NULL,
    idem_key     TEXT NOT NULL,
    scope        TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    status       INTEGER,
    body         TEXT,
    created_at   BIGINT NOT NULL,
    PRIMARY KEY (workspace_id, idem_key)
);
CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at);
