-- The host writes each turn's transcript (DESIGN §9 invariant 9): a part that came from the sandbox's
-- stream keeps the index it had there, so a recorder that starts again (a restarted worker) goes on
-- after the last one it stored; host parts have none.
ALTER TABLE parts ADD COLUMN driver_index INTEGER;
-- How many parts a session has and their bytes: the transcript caps are checked without reading
-- the parts.
ALTER TABLE sessions ADD COLUMN part_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN part_bytes INTEGER NOT NULL DEFAULT 0;
UPDATE sessions SET
    part_count = (SELECT COUNT(*) FROM parts WHERE parts.session_id = sessions.id),
    part_bytes = (SELECT COALESCE(SUM(LENGTH(CAST(payload AS BLOB))), 0) FROM parts WHERE parts.session_id = sessions.id);
-- The nonce the host started a turn with at the driver; a worker that starts again follows the same
-- turn with it (a turn the driver has under another nonce was not started by the host).
ALTER TABLE turns ADD COLUMN driver_nonce TEXT;
-- The session branch's head as the git proxy last saw the upstream take it (its own record of a push
-- it forwarded, never the sandbox's word), kept across a restart of the worker.
ALTER TABLE sessions ADD COLUMN pushed_head TEXT;
