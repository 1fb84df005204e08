// "Files changed": the session's branch against the commit it started from (`GET /diff`), as a
// reviewer reads a pull request: the file list with status and counts, each file's unified diff, and
// the commands to check the branch out.
import { useEffect, useState } from 'react';
import { ApiError, client, type BranchDiff, type FileDiff, type Session } from './api';
import { files as filesWord } from './util';

const STATUS_LETTER: Record<FileDiff['status'], string> = { added: 'A', modified: 'M', deleted: 'D', type_changed: 'T' };

function lineClass(line: string): string {
  if (line.startsWith('+++') || line.startsWith('---') || line.startsWith('diff --git') || line.startsWith('index ')) return 'meta';
  if (line.startsWith('+')) return 'add';
  if (line.startsWith('-')) return 'del';
  if (line.startsWith('@@')) return 'hunk';
  return '';
}

function Patch({ file }: { file: FileDiff }) {
  if (file.binary) return <p className="note">Binary file: no text diff.</p>;
  if (file.patch == null) return <p className="note">The diff of this file is not kept (the branch's diff is over 2 MiB): check the branch out to see it.</p>;
  // The header lines git writes before the first hunk say nothing the row above does not.
  const lines = file.patch.replace(/\n$/, '').split('\n');
  const first = lines.findIndex((l) => l.startsWith('@@'));
  const body = first < 0 ? lines : lines.slice(first);
  return (
    <>
      <pre className="patch">{body.map((l, i) => <div key={i} className={lineClass(l)}>{l || ' '}</div>)}</pre>
      {file.patch_truncated && <p className="note">The diff of this file is cut at 64 KiB: check the branch out to see all of it.</p>}
    </>
  );
}

export function CopyButton({ text, label = 'Copy' }: { text: string; label?: string }) {
  const [done, setDone] = useState(false);
  return (
    <button type="button" className="copy" onClick={() => {
      void navigator.clipboard?.writeText(text).then(() => { setDone(true); setTimeout(() => setDone(false), 1500); }).catch(() => {});
    }}>{done ? 'Copied' : label}</button>
  );
}

/** The commands that bring the branch to a local clone of the repository. */
export function checkoutCommands(branch: string): string {
  return `git fetch origin ${branch}\ngit switch ${branch}`;
}

export function FilesChanged({ session }: { session: Session }) {
  const [diff, setDiff] = useState<BranchDiff | null>(null);
  const [more, setMore] = useState<FileDiff[]>([]);
  const [next, setNext] = useState<number | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [loading, setLoading] = useState(false);
  // A new delivery moves the head: read the diff again.
  useEffect(() => {
    let live = true;
    client.diff(session.id).then((d) => {
      if (!live) return;
      setDiff(d); setMore([]); setNext(d.next_offset ?? null); setError(null);
    }).catch((e: ApiError) => { if (live) setError(e.message); });
    return () => { live = false; };
  }, [session.id, session.head_sha]);
  const loadMore = async () => {
    if (next === null) return;
    setLoading(true);
    try {
      const page = await client.diff(session.id, next);
      setMore((m) => [...m, ...page.files]);
      setNext(page.next_offset ?? null);
    } catch (e) { setError((e as ApiError).message); } finally { setLoading(false); }
  };
  const commands = checkoutCommands(session.branch);
  return (
    <section className="files-changed" aria-label="files changed">
      <div className="checkout">
        <div className="checkout-head">
          <strong>Check the branch out</strong>
          {session.pr && <a href={session.pr.url}>Pull request #{session.pr.number}</a>}
        </div>
        <div className="checkout-row"><pre className="commands">{commands}</pre><CopyButton text={commands} /></div>
      </div>
      {error && <p className="error" role="alert">{error}</p>}
      {!diff ? !error && <p className="empty">Loading the diff…</p>
        : diff.head_sha == null ? <p className="empty">Nothing delivered yet: the branch shows here once a turn pushes it.</p>
          : (
            <>
              <p className="diff-summary" aria-label="branch diff stat">
                {filesWord(diff.files_changed)} <span className="add">+{diff.insertions}</span> <span className="del">−{diff.deletions}</span>
                {' '}against <code>{(diff.base_sha ?? '').slice(0, 10)}</code>{diff.base && <> (<code>{diff.base}</code>)</>} at <code>{diff.head_sha.slice(0, 10)}</code>
              </p>
              <ul className="file-list">
                {[...diff.files, ...more].map((f) => (
                  <li key={f.path}>
                    <details className="file" open={diff.files_changed <= 20}>
                      <summary>
                        <span className={`file-status fs-${f.status}`} title={f.status.replace('_', ' ')}>{STATUS_LETTER[f.status]}</span>
                        <code className="file-path">{f.path}</code>
                        <span className="file-stat">{f.binary ? 'binary' : <><span className="add">+{f.insertions}</span> <span className="del">−{f.deletions}</span></>}</span>
                      </summary>
                      <Patch file={f} />
                    </details>
                  </li>
                ))}
              </ul>
              {next !== null && <button onClick={() => void loadMore()} disabled={loading}>Show more files</button>}
              {diff.truncated && <p className="note">The branch changes more files than sortie keeps a list of (3,000): check it out to see them all.</p>}
            </>
          )}
    </section>
  );
}
