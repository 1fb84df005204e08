-- The workers that run turns (a turn's claimed_by names one) and where each serves the live copies of its
-- running turns to gateways on other hosts (NULL: nowhere; a gateway then waits for the stored transcript).
CREATE TABLE workers (
    id            TEXT PRIMARY KEY,
    feed_url      TEXT,
    registered_at BIGINT NOT NULL
);
