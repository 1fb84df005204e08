-- A session's caps (DESIGN §12, §16): model tokens, and CPU milliseconds of its sandboxes; NULL: none.
-- budget_paused_at is set while the model proxy holds the agent's request at the token cap.
ALTER TABLE sessions ADD COLUMN budget_tokens BIGINT;
ALTER TABLE sessions ADD COLUMN budget_compute_ms BIGINT;
ALTER TABLE sessions ADD COLUMN budget_paused_at BIGINT;

-- A workspace's default budget and quotas, as the api's JSON (`WorkspaceLimits`).
ALTER TABLE workspaces ADD COLUMN limits TEXT NOT NULL DEFAULT '{}';
