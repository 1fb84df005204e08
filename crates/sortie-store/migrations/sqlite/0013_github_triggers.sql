-- A GitHub App connection's webhook secret (sealed like its key, bound to the workspace and host) and its
-- triggers: the JSON of sortie_protocol::api::ForgeTriggers (which repositories' @sortie comments the
-- workspace takes, and the sessions they start). NULL: the App's deliveries are refused / no triggers.
ALTER TABLE forge_connections ADD COLUMN webhook_secret_ciphertext TEXT;
ALTER TABLE forge_connections ADD COLUMN webhook_secret_nonce TEXT;
ALTER TABLE forge_connections ADD COLUMN triggers TEXT;

-- One GitHub App's webhook goes to one place: one connection of the instance per App ID takes its
-- deliveries (a delivery's signature is checked against that one secret, whoever sends it).
CREATE UNIQUE INDEX forge_connections_webhook_app ON forge_connections (app_id)
    WHERE webhook_secret_ciphertext IS NOT NULL;

-- The requests (comments, assignments) in the forge's webhook deliveries a connection's secret verified,
-- once each: by the delivery id (GitHub's X-GitHub-Delivery, the same on a redelivery), and by the
-- request's own key from the signed body (the comment's id), so a signed body sent again under a new
-- delivery id is not acted on twice either. A worker claims a pending one (claimed_by, claimed_at), acts
-- on it and records what it did (outcome), emptying the payload; a claim older than a lease is taken again.
CREATE TABLE forge_deliveries (
    delivery_id  TEXT PRIMARY KEY,
    request_key  TEXT NOT NULL UNIQUE,
    workspace_id TEXT NOT NULL,
    host         TEXT NOT NULL,
    event        TEXT NOT NULL,
    payload      TEXT NOT NULL,
    received_at  INTEGER NOT NULL,
    claimed_by   TEXT,
    claimed_at   INTEGER,
    done_at      INTEGER,
    outcome      TEXT
);
CREATE INDEX forge_deliveries_pending ON forge_deliveries (done_at, received_at);

-- Where a session was asked for from a forge (an issue or pull request comment): the JSON of
-- sortie_store::SessionOrigin, so the worker answers there when the pull request is opened.
CREATE TABLE session_origins (
    session_id TEXT PRIMARY KEY,
    origin     TEXT NOT NULL
);
