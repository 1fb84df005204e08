-- A token may expire (it then signs nothing in, like a revoked one), and says when it was last used
-- (written at most once a minute per token, off the request path).
ALTER TABLE tokens ADD COLUMN expires_at INTEGER;
ALTER TABLE tokens ADD COLUMN last_used_at INTEGER;

-- What admins did: tokens created and revoked, keys and forge connections set and removed, webhooks
-- added and removed. `actor` is the token that did it (`tok_…`) or `cli` for the local admin commands.
CREATE TABLE audit_log (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    workspace_id TEXT NOT NULL REFERENCES workspaces (id),
    at           INTEGER NOT NULL,
    actor        TEXT NOT NULL,
    action       TEXT NOT NULL,
    target       TEXT NOT NULL
);
CREATE INDEX audit_log_by_workspace ON audit_log (workspace_id, id);
