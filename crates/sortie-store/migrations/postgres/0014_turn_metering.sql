-- What each turn's sandbox used, read from its cgroups when the turn ends (and the remainder when the
-- sandbox is destroyed): CPU milliseconds and the sandbox's peak memory up to then. `sessions.compute_ms`
-- is their sum; `sandboxes.cpu_ms` is the sandbox's cumulative reading already metered, so a reading is
-- counted once whatever reads it again.
ALTER TABLE turns ADD COLUMN cpu_ms BIGINT NOT NULL DEFAULT 0;
ALTER TABLE turns ADD COLUMN peak_memory_bytes BIGINT NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN peak_memory_bytes BIGINT NOT NULL DEFAULT 0;
