-- A forge connection as a GitHub App: the App ID (or client ID) its JWT names; the sealed secret is then the
-- App's private key (PEM), from which installation tokens are minted per repository. NULL: a personal token.
ALTER TABLE forge_connections ADD COLUMN app_id TEXT;
