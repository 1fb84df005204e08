-- Per-turn phase timings (ms by phase name, JSON object), written by the worker at turn end.
ALTER TABLE turns ADD COLUMN timings TEXT;
