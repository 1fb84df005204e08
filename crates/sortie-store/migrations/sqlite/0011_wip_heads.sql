-- The commit a session's pod kept at refs/sortie/wip/<session> when a delivery failed, as the git proxy
-- saw the upstream take it (never as the pod reported it): the session's next pod starts from its files.
-- Cleared when the session's branch is delivered again or the ref is deleted.
ALTER TABLE sessions ADD COLUMN wip_head TEXT;
