-- When retention pruned an ended session's transcript, diff and home snapshot (and the worker its
-- directories). The session, its turns and its usage stay: the list and the bill still answer.
ALTER TABLE sessions ADD COLUMN pruned_at INTEGER;
