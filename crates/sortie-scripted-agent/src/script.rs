//! The script language: a pure parser from prompt text to [`Step`]s.
//!
//! Parsing happens before anything runs, so a script with a mistake anywhere does nothing at all and the
//! turn fails with a [`ScriptError`] naming the offending line.

use std::fmt;

/// The first line that marks a prompt as a script (surrounding whitespace is ignored).
pub const SCRIPT_MARKER: &str = "#!scripted";

/// The line that ends the content of a `write:` step.
pub const WRITE_TERMINATOR: &str = ">>>";

/// One step of a script, in the order the agent performs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// `think: TEXT`: one `agent_thought_chunk`.
    Think(String),
    /// `say: TEXT`: `agent_message_chunk`s, split into pieces of at most 64 bytes.
    Say(String),
    /// `plan: A | B | C`: a `plan` update whose entries are all pending; replaces any earlier plan.
    Plan(Vec<String>),
    /// `done: N`: marks entry N (1-based) of the current plan completed and re-sends the plan.
    Done(usize),
    /// `write: PATH` + content lines + `>>>`: writes a file relative to the session cwd.
    Write {
        /// The path as written in the script (relative paths are resolved against the session cwd).
        path: String,
        /// The content lines, each terminated by `\n`.
        content: String,
    },
    /// `run: COMMAND`: runs `sh -c COMMAND` in the session cwd.
    Run(String),
    /// `ask: TEXT`: a `session/request_permission` round trip; the answer is reported as a message chunk.
    Ask(String),
    /// `sleep: MS`: waits, but `session/cancel` interrupts the wait.
    Sleep {
        /// How long to wait, in milliseconds.
        millis: u64,
    },
    /// `hang: MS`: waits and ignores `session/cancel` while waiting.
    Hang {
        /// How long to wait, in milliseconds.
        millis: u64,
    },
    /// `flood: N`: N message chunks as fast as possible.
    Flood(u64),
    /// `fail: TEXT`: ends the turn with a JSON-RPC error whose message is TEXT.
    Fail(String),
    /// `crash: CODE`: exits the process with CODE after flushing what was already sent.
    Crash(i32),
    /// `garbage: TEXT`: writes TEXT as a raw, non-JSON-RPC line on stdout.
    Garbage(String),
    /// `bigline: N`: writes one raw line of N bytes on stdout.
    BigLine(usize),
    /// `stderr: TEXT`: writes TEXT as a line on stderr.
    Stderr(String),
}

/// A script that cannot be run, with the 1-based line of the prompt (the marker is line 1) that is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("script line {line}: {problem}")]
pub struct ScriptError {
    /// 1-based line number in the prompt text.
    pub line: usize,
    /// What is wrong with that line.
    pub problem: ScriptProblem,
}

/// What is wrong with a script line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScriptProblem {
    /// The prompt does not start with [`SCRIPT_MARKER`].
    #[error("a script must start with a `{SCRIPT_MARKER}` line")]
    MissingMarker,
    /// The line has no `name:` prefix.
    #[error("expected `step: argument`, got `{0}`")]
    NotAStep(String),
    /// The step name is not one this agent knows.
    #[error("unknown step `{0}:`")]
    UnknownStep(String),
    /// The step's argument is missing or malformed.
    #[error("`{step}:` needs {expected}, got `{got}`")]
    BadArgument {
        /// The step name.
        step: StepName,
        /// A description of what the argument should be.
        expected: &'static str,
        /// The argument as written.
        got: String,
    },
    /// A `write:` step whose content is never closed by a [`WRITE_TERMINATOR`] line.
    #[error("`write: {path}` has no closing `{WRITE_TERMINATOR}` line")]
    UnterminatedWrite {
        /// The path of the unterminated `write:` step.
        path: String,
    },
    /// A `done:` step that names an entry the current plan does not have.
    #[error("`done: {entry}` but the current plan has {entries} entries")]
    NoSuchPlanEntry {
        /// The 1-based entry number from the script.
        entry: usize,
        /// How many entries the current plan has (0 when there is no plan yet).
        entries: usize,
    },
}

/// The names of all steps, as written before the colon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepName {
    Think,
    Say,
    Plan,
    Done,
    Write,
    Run,
    Ask,
    Sleep,
    Hang,
    Flood,
    Fail,
    Crash,
    Garbage,
    BigLine,
    Stderr,
}

impl StepName {
    /// Every step name, for documentation and error messages.
    pub const ALL: [StepName; 15] = [
        StepName::Think,
        StepName::Say,
        StepName::Plan,
        StepName::Done,
        StepName::Write,
        StepName::Run,
        StepName::Ask,
        StepName::Sleep,
        StepName::Hang,
        StepName::Flood,
        StepName::Fail,
        StepName::Crash,
        StepName::Garbage,
        StepName::BigLine,
        StepName::Stderr,
    ];

    /// The name as it appears in a script.
    pub fn as_str(self) -> &'static str {
        match self {
            StepName::Think => "think",
            StepName::Say => "say",
            StepName::Plan => "plan",
            StepName::Done => "done",
            StepName::Write => "write",
            StepName::Run => "run",
            StepName::Ask => "ask",
            StepName::Sleep => "sleep",
            StepName::Hang => "hang",
            StepName::Flood => "flood",
            StepName::Fail => "fail",
            StepName::Crash => "crash",
            StepName::Garbage => "garbage",
            StepName::BigLine => "bigline",
            StepName::Stderr => "stderr",
        }
    }

    fn from_script(name: &str) -> Option<StepName> {
        StepName::ALL.into_iter().find(|step| step.as_str() == name)
    }
}

impl fmt::Display for StepName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether `prompt` is a script, i.e. one of its lines is [`SCRIPT_MARKER`]. What comes before that line
/// is context the script ignores, as a platform wraps a user's words (a task asked for in an issue).
pub fn is_script(prompt: &str) -> bool {
    prompt.lines().any(|line| line.trim() == SCRIPT_MARKER)
}

/// Parses a script (a prompt with a [`SCRIPT_MARKER`] line, the steps after it) into its steps.
///
/// Blank lines and lines starting with `#` are skipped between steps (not inside `write:` content). The
/// argument is the text after the first colon, minus one optional space, so `say:  x` says ` x`.
pub fn parse_script(prompt: &str) -> Result<Vec<Step>, ScriptError> {
    // Line numbers start at 1 for the marker line so errors point at the line the author sees.
    let mut lines = prompt
        .lines()
        .enumerate()
        .map(|(index, text)| (index + 1, text))
        .skip_while(|(_, text)| text.trim() != SCRIPT_MARKER);
    match lines.next() {
        Some((_, first)) if first.trim() == SCRIPT_MARKER => {}
        _ => {
            return Err(ScriptError {
                line: 1,
                problem: ScriptProblem::MissingMarker,
            });
        }
    }

    let mut steps = Vec::new();
    // `done:` is checked against the plan in force at that point, so mistakes surface before anything runs.
    let mut current_plan_entries = 0;
    while let Some((line, text)) = lines.next() {
        let trimmed = text.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let error = |problem| ScriptError { line, problem };
        let Some((raw_name, raw_argument)) = text.split_once(':') else {
            return Err(error(ScriptProblem::NotAStep(trimmed.to_owned())));
        };
        let name = raw_name.trim();
        let Some(step_name) = StepName::from_script(name) else {
            return Err(error(ScriptProblem::UnknownStep(name.to_owned())));
        };
        let argument = raw_argument.strip_prefix(' ').unwrap_or(raw_argument);
        let bad_argument = |expected| {
            error(ScriptProblem::BadArgument {
                step: step_name,
                expected,
                got: argument.to_owned(),
            })
        };

        let step = match step_name {
            StepName::Think => Step::Think(argument.to_owned()),
            StepName::Say => Step::Say(argument.to_owned()),
            StepName::Plan => {
                let entries = parse_plan_entries(argument).ok_or_else(|| bad_argument(PLAN_EXPECTATION))?;
                current_plan_entries = entries.len();
                Step::Plan(entries)
            }
            StepName::Done => {
                let entry: usize = parse_number(argument).ok_or_else(|| bad_argument("an entry number (1-based)"))?;
                if entry == 0 || entry > current_plan_entries {
                    return Err(error(ScriptProblem::NoSuchPlanEntry {
                        entry,
                        entries: current_plan_entries,
                    }));
                }
                Step::Done(entry)
            }
            StepName::Write => {
                let path = argument.trim();
                if path.is_empty() {
                    return Err(bad_argument("a file path"));
                }
                let mut content = String::new();
                let mut terminated = false;
                for (_, content_line) in lines.by_ref() {
                    if content_line.trim_end() == WRITE_TERMINATOR {
                        terminated = true;
                        break;
                    }
                    content.push_str(content_line);
                    content.push('\n');
                }
                if !terminated {
                    return Err(error(ScriptProblem::UnterminatedWrite { path: path.to_owned() }));
                }
                Step::Write {
                    path: path.to_owned(),
                    content,
                }
            }
            StepName::Run => {
                if argument.trim().is_empty() {
                    return Err(bad_argument("a shell command"));
                }
                Step::Run(argument.to_owned())
            }
            StepName::Ask => Step::Ask(argument.to_owned()),
            StepName::Sleep => Step::Sleep {
                millis: parse_number(argument).ok_or_else(|| bad_argument(MILLIS_EXPECTATION))?,
            },
            StepName::Hang => Step::Hang {
                millis: parse_number(argument).ok_or_else(|| bad_argument(MILLIS_EXPECTATION))?,
            },
            StepName::Flood => Step::Flood(parse_number(argument).ok_or_else(|| bad_argument("a number of chunks"))?),
            StepName::Fail => Step::Fail(argument.to_owned()),
            StepName::Crash => Step::Crash(parse_number(argument).ok_or_else(|| bad_argument("an exit code"))?),
            StepName::Garbage => Step::Garbage(argument.to_owned()),
            StepName::BigLine => {
                Step::BigLine(parse_number(argument).ok_or_else(|| bad_argument("a line length in bytes"))?)
            }
            StepName::Stderr => Step::Stderr(argument.to_owned()),
        };
        steps.push(step);
    }
    Ok(steps)
}

const PLAN_EXPECTATION: &str = "non-empty entries separated by `|`";
const MILLIS_EXPECTATION: &str = "a duration in milliseconds";

fn parse_number<N: std::str::FromStr>(argument: &str) -> Option<N> {
    argument.trim().parse().ok()
}

/// `A | B | C` → `["A", "B", "C"]`; an empty argument is an empty plan, an empty entry is a mistake.
fn parse_plan_entries(argument: &str) -> Option<Vec<String>> {
    if argument.trim().is_empty() {
        return Some(Vec::new());
    }
    argument
        .split('|')
        .map(|entry| {
            let entry = entry.trim();
            (!entry.is_empty()).then(|| entry.to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    type Parsed = Result<Vec<Step>, ScriptError>;

    fn step_error(line: usize, problem: ScriptProblem) -> Parsed {
        Err(ScriptError { line, problem })
    }

    fn bad(line: usize, step: StepName, expected: &'static str, got: &str) -> Parsed {
        step_error(
            line,
            ScriptProblem::BadArgument {
                step,
                expected,
                got: got.to_owned(),
            },
        )
    }

    #[test]
    fn parses_a_table_of_scripts() {
        let cases: Vec<(&str, &str, Parsed)> = vec![
            ("marker only", "#!scripted", Ok(vec![])),
            ("marker with spaces", "  #!scripted  \n", Ok(vec![])),
            ("think", "#!scripted\nthink: hmm", Ok(vec![Step::Think("hmm".into())])),
            (
                "say keeps extra spaces",
                "#!scripted\nsay:  hi ",
                Ok(vec![Step::Say(" hi ".into())]),
            ),
            (
                "say without space",
                "#!scripted\nsay:hi",
                Ok(vec![Step::Say("hi".into())]),
            ),
            ("empty say", "#!scripted\nsay:", Ok(vec![Step::Say(String::new())])),
            (
                "colon in text",
                "#!scripted\nsay: a: b",
                Ok(vec![Step::Say("a: b".into())]),
            ),
            (
                "blank and comment lines are skipped",
                "#!scripted\n\n# a comment\n   \nsay: x",
                Ok(vec![Step::Say("x".into())]),
            ),
            (
                "crlf line endings",
                "#!scripted\r\nsay: x\r\n",
                Ok(vec![Step::Say("x".into())]),
            ),
            (
                "plan and done",
                "#!scripted\nplan: A | B |C\ndone: 2\ndone: 3",
                Ok(vec![
                    Step::Plan(vec!["A".into(), "B".into(), "C".into()]),
                    Step::Done(2),
                    Step::Done(3),
                ]),
            ),
            ("empty plan", "#!scripted\nplan:", Ok(vec![Step::Plan(vec![])])),
            (
                "a later plan replaces the earlier one",
                "#!scripted\nplan: A | B\nplan: C\ndone: 2",
                step_error(4, ScriptProblem::NoSuchPlanEntry { entry: 2, entries: 1 }),
            ),
            (
                "done without plan",
                "#!scripted\ndone: 1",
                step_error(2, ScriptProblem::NoSuchPlanEntry { entry: 1, entries: 0 }),
            ),
            (
                "done zero",
                "#!scripted\nplan: A\ndone: 0",
                step_error(3, ScriptProblem::NoSuchPlanEntry { entry: 0, entries: 1 }),
            ),
            (
                "done not a number",
                "#!scripted\nplan: A\ndone: x",
                bad(3, StepName::Done, "an entry number (1-based)", "x"),
            ),
            (
                "empty plan entry",
                "#!scripted\nplan: A || B",
                bad(2, StepName::Plan, PLAN_EXPECTATION, "A || B"),
            ),
            (
                "write with content",
                "#!scripted\nwrite: src/a.txt\nline 1\n\n# not a comment here\n>>>\nsay: after",
                Ok(vec![
                    Step::Write {
                        path: "src/a.txt".into(),
                        content: "line 1\n\n# not a comment here\n".into(),
                    },
                    Step::Say("after".into()),
                ]),
            ),
            (
                "write of an empty file",
                "#!scripted\nwrite: empty\n>>>",
                Ok(vec![Step::Write {
                    path: "empty".into(),
                    content: String::new(),
                }]),
            ),
            (
                "unterminated write",
                "#!scripted\nsay: x\nwrite: a.txt\nhello",
                step_error(3, ScriptProblem::UnterminatedWrite { path: "a.txt".into() }),
            ),
            (
                "write without path",
                "#!scripted\nwrite:  \n>>>",
                bad(2, StepName::Write, "a file path", " "),
            ),
            (
                "run",
                "#!scripted\nrun: echo hi && exit 3",
                Ok(vec![Step::Run("echo hi && exit 3".into())]),
            ),
            (
                "run without command",
                "#!scripted\nrun:",
                bad(2, StepName::Run, "a shell command", ""),
            ),
            ("ask", "#!scripted\nask: May I?", Ok(vec![Step::Ask("May I?".into())])),
            ("sleep", "#!scripted\nsleep: 250", Ok(vec![Step::Sleep { millis: 250 }])),
            (
                "sleep negative",
                "#!scripted\nsleep: -1",
                bad(2, StepName::Sleep, MILLIS_EXPECTATION, "-1"),
            ),
            ("hang", "#!scripted\nhang: 10", Ok(vec![Step::Hang { millis: 10 }])),
            ("flood", "#!scripted\nflood: 1000", Ok(vec![Step::Flood(1000)])),
            (
                "flood junk",
                "#!scripted\nflood: many",
                bad(2, StepName::Flood, "a number of chunks", "many"),
            ),
            ("fail", "#!scripted\nfail: boom", Ok(vec![Step::Fail("boom".into())])),
            ("crash", "#!scripted\ncrash: 7", Ok(vec![Step::Crash(7)])),
            (
                "crash junk",
                "#!scripted\ncrash: seven",
                bad(2, StepName::Crash, "an exit code", "seven"),
            ),
            (
                "garbage",
                "#!scripted\ngarbage: {not json",
                Ok(vec![Step::Garbage("{not json".into())]),
            ),
            (
                "bigline",
                "#!scripted\nbigline: 100000",
                Ok(vec![Step::BigLine(100_000)]),
            ),
            (
                "stderr",
                "#!scripted\nstderr: oops",
                Ok(vec![Step::Stderr("oops".into())]),
            ),
            (
                "unknown step names the line",
                "#!scripted\nsay: ok\nfrobnicate: x",
                step_error(3, ScriptProblem::UnknownStep("frobnicate".into())),
            ),
            (
                "step names are case-sensitive",
                "#!scripted\nSay: x",
                step_error(2, ScriptProblem::UnknownStep("Say".into())),
            ),
            (
                "line without colon",
                "#!scripted\nhello there",
                step_error(2, ScriptProblem::NotAStep("hello there".into())),
            ),
            ("no marker", "say: x", step_error(1, ScriptProblem::MissingMarker)),
            (
                "context before the marker",
                "Asked in issue #7: do it\n\n#!scripted\nsay: x",
                Ok(vec![Step::Say("x".into())]),
            ),
            ("empty prompt", "", step_error(1, ScriptProblem::MissingMarker)),
        ];

        for (name, script, expected) in cases {
            assert_eq!(parse_script(script), expected, "case `{name}`");
        }
    }

    #[test]
    fn recognises_scripts_by_their_marker_line() {
        assert!(is_script("#!scripted\nsay: x"));
        assert!(is_script("#!scripted"));
        assert!(is_script("context first\n#!scripted"));
        assert!(!is_script("hello #!scripted"));
        assert!(!is_script(""));
        assert!(!is_script("#!scripted-not"));
    }

    #[test]
    fn errors_name_the_line_in_their_message() {
        let error = parse_script("#!scripted\nsay: x\nfrobnicate: y").expect_err("unknown step must fail");
        assert_eq!(error.to_string(), "script line 3: unknown step `frobnicate:`");
    }

    #[test]
    fn every_step_name_round_trips() {
        for step in StepName::ALL {
            assert_eq!(StepName::from_script(step.as_str()), Some(step));
        }
    }
}
