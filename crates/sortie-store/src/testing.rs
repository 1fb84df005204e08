//! Databases for tests: a SQLite file in a directory the test owns, or a fresh PostgreSQL database
//! per test on the local server (dropped again when the handle is dropped).
//!
//! The PostgreSQL server is `SORTIE_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`);
//! the user is always in the URL because `$USER` is unset in CI.

use std::path::Path;

use sqlx::{Connection, Executor};

use crate::{StoreError, StoreResult};

/// The environment variable naming the PostgreSQL server tests create their databases on.
pub const TEST_POSTGRES_URL_ENV: &str = "SORTIE_TEST_POSTGRES_URL";
const DEFAULT_TEST_POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Whether a PostgreSQL test runs. With [`TEST_POSTGRES_URL_ENV`] set (the test command sets it) it
/// always does, and a server that does not answer fails it. Without it, a contributor with no
/// PostgreSQL on the default address runs the SQLite half: this says on stderr that `test` was
/// skipped and why, and returns `false`.
pub async fn postgres_available(test: &str) -> bool {
    static ANSWERS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if std::env::var_os(TEST_POSTGRES_URL_ENV).is_some() {
        return true;
    }
    let answers = match ANSWERS.get() {
        Some(answers) => *answers,
        None => {
            let connect = sqlx::PgConnection::connect(DEFAULT_TEST_POSTGRES_URL);
            let answers = matches!(
                tokio::time::timeout(std::time::Duration::from_secs(3), connect).await,
                Ok(Ok(_))
            );
            *ANSWERS.get_or_init(|| answers)
        }
    };
    if !answers {
        use std::io::Write;
        // Past the test harness's capture, which would hide it for a test that passes.
        let _ = writeln!(
            std::io::stderr(),
            "skipped {test}: no PostgreSQL answers at {DEFAULT_TEST_POSTGRES_URL} (set {TEST_POSTGRES_URL_ENV} to \
             require one; scripts/test does)"
        );
    }
    answers
}

/// Which database a test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestBackend {
    Sqlite,
    Postgres,
}

/// A database a test owns.
pub struct TestDatabase {
    pub url: String,
    postgres: Option<(String, String)>,
}

impl TestDatabase {
    /// A database of the given backend; SQLite lives in `dir`.
    pub async fn new(backend: TestBackend, dir: &Path) -> StoreResult<Self> {
        match backend {
            TestBackend::Sqlite => Ok(Self::sqlite(dir)),
            TestBackend::Postgres => Self::postgres().await,
        }
    }

    pub fn sqlite(dir: &Path) -> Self {
        Self {
            url: format!("sqlite://{}", dir.join("sortie.db").display()),
            postgres: None,
        }
    }

    pub async fn postgres() -> StoreResult<Self> {
        let admin_url = std::env::var(TEST_POSTGRES_URL_ENV).unwrap_or_else(|_| DEFAULT_TEST_POSTGRES_URL.to_owned());
        let name = format!(
            "sortie_test_{}",
            ulid::Ulid::generate().to_string().to_ascii_lowercase()
        );
        let mut admin = sqlx::PgConnection::connect(&admin_url).await?;
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await?;
        admin.close().await?;
        let (base, _) = admin_url
            .rsplit_once('/')
            .ok_or_else(|| StoreError::Internal(format!("{TEST_POSTGRES_URL_ENV} has no database path")))?;
        Ok(Self {
            url: format!("{base}/{name}"),
            postgres: Some((admin_url, name)),
        })
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let Some((admin_url, name)) = self.postgres.take() else {
            return;
        };
        // Drop may run inside a runtime, which cannot block on another: use a thread of its own.
        let dropper = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            runtime.block_on(async {
                if let Ok(mut admin) = sqlx::PgConnection::connect(&admin_url).await {
                    let _ = admin
                        .execute(sqlx::AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                        )))
                        .await;
                    let _ = admin.close().await;
                }
            });
        });
        let _ = dropper.join();
    }
}
