// Command output as a terminal block, whichever agent ran the command. Agents report a shell tool in
// different shapes (ACP leaves `rawInput`/`rawOutput` to them), so the command, the text and the exit code
// are read from every shape we know; what is not recognised stays in the tool card's raw JSON view.
import { useState } from 'react';

/** What a terminal block shows: the command (when known), its output text, its exit code (when known). */
export interface CommandRun { command: string | null; text: string; exitCode: number | null; signal: string | null }

type Json = Record<string, unknown>;
const isObject = (v: unknown): v is Json => typeof v === 'object' && v !== null && !Array.isArray(v);
const firstString = (...vs: unknown[]) => vs.find((v): v is string => typeof v === 'string');
const firstNumber = (...vs: unknown[]) => vs.find((v): v is number => typeof v === 'number' && Number.isFinite(v));

/** The tool names (ACP kinds, or an agent's own tool names) that run a command. */
const COMMAND_TOOLS = new Set(['execute', 'bash', 'shell', 'exec_command', 'run_shell_command', 'local_shell', 'terminal']);

/** The command line a tool's input names: `command` (a string or argv), `cmd`, or `commandLine`. */
export function commandOf(input: unknown): string | null {
  if (!isObject(input)) return null;
  const raw = input.command ?? input.cmd ?? input.commandLine;
  if (typeof raw === 'string') return raw;
  if (Array.isArray(raw) && raw.every((a) => typeof a === 'string')) {
    // `["bash", "-lc", "npm test"]` is the command `npm test`.
    const argv = raw as string[];
    if (argv.length === 3 && /(^|\/)(ba|z|da)?sh$/.test(argv[0]) && /^-l?c$/.test(argv[1])) return argv[2];
    return argv.join(' ');
  }
  return null;
}

/** The exit code and signal a tool's raw output reports, in any of the shapes agents use. */
function exitOf(raw: unknown): { exitCode: number | null; signal: string | null } {
  if (!isObject(raw)) return { exitCode: null, signal: null };
  const meta = isObject(raw.metadata) ? raw.metadata : {};
  const exitStatus = isObject(raw.exitStatus) ? raw.exitStatus : {};
  const exitCode = firstNumber(raw.exitCode, raw.exit_code, raw.exit, raw.returncode, raw.code, meta.exit, meta.exitCode, meta.exit_code, exitStatus.exitCode) ?? null;
  const signal = firstString(raw.signal, exitStatus.signal) ?? null;
  return { exitCode, signal };
}

/** The text a raw output carries: `output`, `stdout` and `stderr`, `aggregated_output`, or its metadata's. */
function textOf(raw: unknown): string | null {
  if (typeof raw === 'string') return raw;
  if (!isObject(raw)) return null;
  const meta = isObject(raw.metadata) ? raw.metadata : {};
  const direct = firstString(raw.text, raw.output, raw.formatted_output, raw.aggregated_output, meta.output);
  if (direct != null) return direct;
  const out = firstString(raw.stdout);
  const err = firstString(raw.stderr);
  if (out != null || err != null) return [out, err].filter(Boolean).join(out && err && !out.endsWith('\n') ? '\n' : '');
  return null;
}

/** Text wrapped whole in a Markdown code fence (```console … ```), without the fence. */
function unfence(text: string | null): string | null {
  const fenced = text === null ? null : /^```[\w-]*\n([\s\S]*?)\n?```\s*$/.exec(text);
  return fenced ? fenced[1] : text;
}

/**
 * A tool part as a command run, or null when it is not one. A part is one when its tool runs commands
 * (by name, or an input with a command) and its output — or its error — is text, possibly with a raw
 * report beside it (`{text, raw}`, as sortie's driver maps an ACP tool's text content and `rawOutput`).
 */
export function commandRun(part: { readonly [field: string]: unknown }): CommandRun | null {
  const command = commandOf(part.input);
  const named = typeof part.toolName === 'string' && COMMAND_TOOLS.has(part.toolName);
  if (!named && command === null) return null;
  let output: unknown = part.output;
  if (part.state === 'output-error' && typeof part.errorText === 'string') {
    // A failed call's error is text, or the raw report as JSON (`{"exitCode":3}`).
    try {
      const parsed: unknown = JSON.parse(part.errorText);
      output = isObject(parsed) ? parsed : part.errorText;
    } catch { output = part.errorText; }
  }
  let text: string | null;
  let exit: { exitCode: number | null; signal: string | null };
  if (isObject(output) && 'raw' in output) {
    // The raw report is the command's own text when it is a string (Claude Code's: its `text` is the
    // same wrapped in a Markdown fence).
    text = typeof output.raw === 'string' ? output.raw : unfence(textOf(output.text)) ?? textOf(output.raw);
    exit = exitOf(output.raw);
  } else {
    text = textOf(output);
    exit = exitOf(output);
  }
  if (text === null && output != null && !isObject(output)) return null;
  const title = typeof part.title === 'string' ? part.title.replace(/^`(.*)`$/s, '$1') : null;
  return { command: command ?? title, text: text ?? '', ...exit };
}

/**
 * Terminal text as a reader should see it: escape sequences (colours, cursor moves) dropped, a carriage
 * return's overwritten line kept as its last state, and other control characters removed.
 */
export function cleanTerminalText(text: string): string {
  return text
    // CSI and OSC sequences, then lone escapes.
    .replace(/\u001b\[[0-?]*[ -/]*[@-~]/g, '')
    .replace(/\u001b\][^\u0007\u001b]*(\u0007|\u001b\\)/g, '')
    .replace(/\u001b[@-_]/g, '')
    .split('\n')
    .map((line) => {
      const end = line.endsWith('\r') ? line.slice(0, -1) : line;
      const last = end.lastIndexOf('\r');
      return last < 0 ? end : end.slice(last + 1);
    })
    .join('\n')
    // eslint-disable-next-line no-control-regex
    .replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g, '');
}

/** Lines shown before "show all": the tail, where test results and errors are. */
export const TAIL_LINES = 12;

export function TerminalBlock({ run, running, took }: { run: CommandRun; running?: boolean; took?: string | null }) {
  const [all, setAll] = useState(false);
  const text = cleanTerminalText(run.text).replace(/\n$/, '');
  const lines = text === '' ? [] : text.split('\n');
  const long = lines.length > TAIL_LINES + 3;
  const shown = long && !all ? lines.slice(-TAIL_LINES) : lines;
  const ok = run.exitCode === 0;
  return (
    <div className="term" data-exit={run.exitCode ?? undefined}>
      <div className="term-head">
        {run.command != null && <code className="term-cmd"><span aria-hidden="true">$ </span>{run.command}</code>}
        <span className="term-meta">
          {running ? <span className="exit exit-running">running</span>
            : run.exitCode != null ? <span className={`exit ${ok ? 'exit-ok' : 'exit-fail'}`} aria-label={`exit code ${run.exitCode}`}>exit {run.exitCode}</span>
              : run.signal ? <span className="exit exit-fail">{run.signal}</span> : null}
          {took && <span className="took">{took}</span>}
        </span>
      </div>
      {long && <button className="link more" aria-expanded={all} onClick={() => setAll(!all)}>{all ? `Show the last ${TAIL_LINES} lines` : `Show all ${lines.length} lines`}</button>}
      {lines.length > 0 ? <pre className="term-out">{shown.join('\n')}</pre>
        : !running && <div className="term-empty">{run.exitCode == null ? 'the agent reported no output' : 'no output'}</div>}
    </div>
  );
}
