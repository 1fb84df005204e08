// The terminal block over the shapes each agent reports a shell command in, recorded: the scripted
// agent's through `sortie driver` (fixtures/scripted-turn.sse), and each real agent's own shell tool
// (Claude Code's Bash, Codex's exec_command, Gemini CLI's run_shell_command, opencode's bash) as
// crates/sortie/tests/agents.rs recorded them from real runs (fixtures/agents/*-shell.json,
// SORTIE_RECORD_FIXTURES=1). Further shapes (failures) are written from the same fields by hand.
import { readdirSync, readFileSync } from 'node:fs';
import { Conversation, type Message } from '../src/conversation';
import { join } from 'node:path';
import { cleanup, fireEvent, render } from '@testing-library/react';
import { afterEach, describe, expect, it } from 'vitest';
import { cleanTerminalText, commandOf, commandRun, TAIL_LINES, TerminalBlock } from '../src/terminal';

afterEach(cleanup);

const recorded = readFileSync(join(__dirname, 'fixtures', 'scripted-turn.sse'), 'utf8')
  .split('\n').filter((l) => l.startsWith('data: {')).map((l) => JSON.parse(l.slice(6)) as Record<string, unknown>);

/** A tool part as the AI SDK builds it from a call's input and output chunks. */
function partOf(callId: string) {
  const input = recorded.find((c) => c.type === 'tool-input-available' && c.toolCallId === callId)!;
  const end = recorded.find((c) => (c.type === 'tool-output-available' || c.type === 'tool-output-error') && c.toolCallId === callId)!;
  return { toolName: input.toolName, title: input.title, input: input.input, state: end.type === 'tool-output-error' ? 'output-error' : 'output-available', output: end.output, errorText: end.errorText };
}

describe('recorded shell calls of the real agents', () => {
  const dir = join(__dirname, 'fixtures', 'agents');
  const recordings = readdirSync(dir).filter((f) => f.endsWith('-shell.json'));
  it('has a recording of each agent', () => {
    expect(recordings.sort()).toEqual(['claude-code-shell.json', 'codex-shell.json', 'gemini-shell.json', 'opencode-shell.json']);
  });
  // What each agent lets us show: the output (Gemini CLI reports none) and the exit code (when reported).
  const expected: Record<string, { text: string | null; exit: string | null }> = {
    'claude-code': { text: 'sortie-shell-ok\nsecond line', exit: null },
    codex: { text: 'sortie-shell-ok\nsecond line', exit: 'exit 0' },
    gemini: { text: null, exit: null },
    opencode: { text: 'sortie-shell-ok\nsecond line', exit: 'exit 0' },
  };
  for (const file of recordings) {
    it(`${file}: the command, its output as text, its exit code, no JSON`, () => {
      const recorded = JSON.parse(readFileSync(join(dir, file), 'utf8')) as { agent: string; parts: Message['parts'] };
      const { container } = render(<Conversation messages={[{ id: 'ses_x-t1', role: 'assistant', parts: recorded.parts }]} actions={{}} />);
      const block = container.querySelector('details.tool-cmd');
      expect(block, 'a terminal block').not.toBeNull();
      expect(block?.querySelector('.term-cmd')?.textContent).toBe("$ printf 'sortie-%s\\n' shell-ok; printf 'second line\\n'");
      const want = expected[recorded.agent];
      expect(block?.querySelector('.term-out')?.textContent ?? null).toBe(want.text);
      if (want.text === null) expect(block?.querySelector('.term-empty')?.textContent).toBe('the agent reported no output');
      expect(block?.querySelector('.exit')?.textContent ?? null).toBe(want.exit);
      expect(container.textContent).not.toMatch(/exitCode|"raw"|```/);
      expect(container.querySelectorAll('.card.terminal'), 'a terminal part shows in its call\'s card').toHaveLength(0);
    });
  }
});

describe('command runs of every agent', () => {
  it('the scripted agent (recorded): text with the exit code beside it, and a failure that is only a raw report', () => {
    expect(commandRun(partOf('turn1-call2'))).toEqual({ command: 'cat hello.txt; echo done', text: 'hello\ndone\n', exitCode: 0, signal: null });
    expect(commandRun(partOf('turn1-call3'))).toEqual({ command: 'exit 3', text: '', exitCode: 3, signal: null });
    expect(commandRun(partOf('turn1-call1')), 'a file edit is not a command').toBeNull();
  });

  it('Claude Code: Bash with {command, description}, its text result, a failure as text', () => {
    const call = { toolName: 'execute', title: '`npm test`', input: { command: 'npm test', description: 'Run the tests' } };
    expect(commandRun({ ...call, state: 'output-available', output: '> test\n\n2 passing\n' }))
      .toEqual({ command: 'npm test', text: '> test\n\n2 passing\n', exitCode: null, signal: null });
    expect(commandRun({ ...call, state: 'output-error', errorText: 'Error: Exit code 1\n1 failing' }))
      .toEqual({ command: 'npm test', text: 'Error: Exit code 1\n1 failing', exitCode: null, signal: null });
  });

  it('Codex: exec_command with an argv, its output and exit code in rawOutput', () => {
    const part = { toolName: 'execute', title: 'cargo test', input: { command: ['bash', '-lc', 'cargo test'], cwd: '/workspace' },
      state: 'output-available', output: { stdout: 'test result: ok. 4 passed\n', stderr: '', exit_code: 0, formatted_output: 'test result: ok. 4 passed\n' } };
    expect(commandRun(part)).toEqual({ command: 'cargo test', text: 'test result: ok. 4 passed\n', exitCode: 0, signal: null });
    expect(commandOf({ command: ['ls', '-la'] })).toBe('ls -la');
  });

  it('Gemini CLI: run_shell_command with text content and no raw report', () => {
    const part = { toolName: 'execute', title: 'pytest -q (Run the tests)', input: { command: 'pytest -q', description: 'Run the tests', directory: '.' },
      state: 'output-available', output: 'Command: pytest -q\nStdout: 3 passed\nExit Code: 0' };
    expect(commandRun(part)?.text).toContain('3 passed');
  });

  it('opencode: bash with rawOutput {output, metadata: {exit}}', () => {
    const part = { toolName: 'execute', title: 'go test ./...', input: { command: 'go test ./...', description: 'Run tests' },
      state: 'output-available', output: { text: 'ok  example 0.01s\n', raw: { output: 'ok  example 0.01s\n', metadata: { exit: 0, description: 'Run tests' } } } };
    expect(commandRun(part)).toEqual({ command: 'go test ./...', text: 'ok  example 0.01s\n', exitCode: 0, signal: null });
    const failed = { ...part, state: 'output-error', output: undefined, errorText: JSON.stringify({ output: 'FAIL\n', metadata: { exit: 1 } }) };
    expect(commandRun(failed)).toEqual({ command: 'go test ./...', text: 'FAIL\n', exitCode: 1, signal: null });
  });

  it('a tool that is not a command, or an unknown structured output, stays a tool card', () => {
    expect(commandRun({ toolName: 'read', input: { path: 'a.txt' }, state: 'output-available', output: 'x' })).toBeNull();
    expect(commandRun({ toolName: 'fetch', input: { url: 'https://x' }, state: 'output-available', output: { status: 200 } })).toBeNull();
  });
});

describe('terminal text', () => {
  it('drops colours and cursor moves, keeps the last state of a line redrawn with carriage returns', () => {
    expect(cleanTerminalText('\u001b[32mok\u001b[0m 3 passed\n')).toBe('ok 3 passed\n');
    expect(cleanTerminalText('10%\r50%\r100%\ndone\r\n')).toBe('100%\ndone\n');
    expect(cleanTerminalText('\u001b]0;title\u0007bell\u0007 \u0000nul')).toBe('bell nul');
  });

  it('shows the tail of long output until "show all", the same whether it failed or not', () => {
    const text = Array.from({ length: 100 }, (_, i) => `line ${i}`).join('\n');
    for (const exitCode of [0, 1]) {
      const { container, getByRole, unmount } = render(<TerminalBlock run={{ command: 'seq', text, exitCode, signal: null }} />);
      expect(container.querySelector('.term-out')?.textContent?.split('\n')).toHaveLength(TAIL_LINES);
      expect(container.querySelector('.term-out')?.textContent?.endsWith('line 99')).toBe(true);
      expect(container.querySelector('.exit')?.textContent).toBe(`exit ${exitCode}`);
      fireEvent.click(getByRole('button', { name: 'Show all 100 lines' }));
      expect(container.querySelector('.term-out')?.textContent?.split('\n')).toHaveLength(100);
      unmount();
    }
  });
});
