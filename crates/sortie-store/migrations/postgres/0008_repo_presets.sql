-- Per-repository presets a workspace's admin keeps for the dashboard's composer: the egress allowlist
-- (JSON array), setup script and agent a new session on that repository starts with.
CREATE TABLE repo_presets (
    workspace_id TEXT NOT NULL,
    repo         TEXT NOT NULL,
    agent        TEXT,
    setup        TEXT,
    egress_allow TEXT NOT NULL,
    updated_at   BIGINT NOT NULL,
    PRIMARY KEY (workspace_id, repo)
);
