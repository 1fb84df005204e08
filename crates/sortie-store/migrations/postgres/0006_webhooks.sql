-- Webhooks (DESIGN §14). The outbox is the events table: an event is written in the transaction of its
-- change, and each webhook's cursor says which events have been turned into its deliveries (advanced
-- with a compare-and-set, so two api replicas never enqueue an event twice). A delivery is retried with
-- backoff for 24 h; its attempts are its log.
CREATE TABLE webhooks (
    id                TEXT PRIMARY KEY,
    workspace_id      TEXT NOT NULL REFERENCES workspaces (id),
    url               TEXT NOT NULL,
    secret_ciphertext TEXT NOT NULL,
    secret_nonce      TEXT NOT NULL,
    events            TEXT NOT NULL,
    event_cursor      BIGINT NOT NULL,
    created_at        BIGINT NOT NULL
);
CREATE INDEX webhooks_workspace ON webhooks (workspace_id);

CREATE TABLE webhook_deliveries (
    id           TEXT PRIMARY KEY,
    webhook_id   TEXT NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
    event_seq    BIGINT NOT NULL,
    kind         TEXT NOT NULL,
    payload      TEXT NOT NULL,
    state        TEXT NOT NULL,
    attempts     BIGINT NOT NULL DEFAULT 0,
    next_at      BIGINT NOT NULL,
    lease_until  BIGINT,
    last_status  BIGINT,
    last_error   TEXT,
    created_at   BIGINT NOT NULL,
    delivered_at BIGINT,
    UNIQUE (webhook_id, event_seq)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (state, next_at);
