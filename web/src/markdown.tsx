// Agent text as GitHub-flavoured Markdown (react-markdown + remark-gfm: tables, task lists, strikethrough,
// autolinks), with fenced code highlighted by lowlight (highlight.js grammars, a few common languages).
// Raw HTML in the text is never rendered and link targets go through react-markdown's URL filter, so an
// agent's text cannot inject markup or script; it builds React elements only.
import { memo, type ReactNode } from 'react';
import { type Components } from 'react-markdown';
import { defaultUrlTransform } from 'react-markdown';
import { unified } from 'unified';
import remarkParse from 'remark-parse';
import remarkRehype from 'remark-rehype';
import remarkGfm from 'remark-gfm';
import type { Element, Root } from 'hast';
import { visit } from 'unist-util-visit';
import { createLowlight } from 'lowlight';
import { toJsxRuntime } from 'hast-util-to-jsx-runtime';
import { Fragment, jsx, jsxs } from 'react/jsx-runtime';
import bash from 'highlight.js/lib/languages/bash';
import css from 'highlight.js/lib/languages/css';
import diff from 'highlight.js/lib/languages/diff';
import go from 'highlight.js/lib/languages/go';
import javascript from 'highlight.js/lib/languages/javascript';
import json from 'highlight.js/lib/languages/json';
import python from 'highlight.js/lib/languages/python';
import rust from 'highlight.js/lib/languages/rust';
import typescript from 'highlight.js/lib/languages/typescript';
import xml from 'highlight.js/lib/languages/xml';
import yaml from 'highlight.js/lib/languages/yaml';
import ini from 'highlight.js/lib/languages/ini';

const lowlight = createLowlight({ bash, css, diff, go, javascript, json, python, rust, typescript, xml, yaml, ini });
lowlight.registerAlias({ bash: ['sh', 'shell', 'console', 'zsh'], javascript: ['js', 'jsx', 'mjs', 'cjs'], typescript: ['ts', 'tsx'], python: ['py'], rust: ['rs'], xml: ['html', 'svg'], yaml: ['yml'], ini: ['toml'] });

/** A fenced block's code, highlighted when its language is one we carry. */
function Code({ className, children }: { className?: string; children?: ReactNode }) {
  const language = /language-([\w+-]+)/.exec(className ?? '')?.[1]?.toLowerCase();
  const text = typeof children === 'string' ? children : Array.isArray(children) ? children.join('') : null;
  if (!language || text === null || !lowlight.registered(language)) return <code className={className}>{children}</code>;
  const tree = lowlight.highlight(language, text.replace(/\n$/, ''));
  return <code className={`${className} hljs`}>{toJsxRuntime(tree, { Fragment, jsx, jsxs })}</code>;
}

const components: Components = {
  // The page's own headings come first (h1 is the session's title): an agent's start at h3.
  h1: ({ children }) => <h3>{children}</h3>,
  h2: ({ children }) => <h4>{children}</h4>,
  h3: ({ children }) => <h5>{children}</h5>,
  h4: ({ children }) => <h6>{children}</h6>,
  h5: ({ children }) => <h6>{children}</h6>,
  a: ({ href, children }) => <a href={href} rel="noreferrer noopener" target="_blank">{children}</a>,
  code: ({ className, children }) => <Code className={className}>{children}</Code>,
  // Wide tables scroll inside themselves.
  table: ({ children }) => <div className="table-wrap"><table>{children}</table></div>,
};
// One processor for every text part (react-markdown builds one per render, which a 1,000-part
// conversation pays a thousand times): Markdown → mdast (GFM) → hast, raw HTML dropped.
const processor = unified().use(remarkParse).use(remarkGfm).use(remarkRehype, { allowDangerousHtml: false });

/** Link and image targets through react-markdown's filter (no `javascript:` and the like). */
function safeUrls(tree: Root) {
  visit(tree, 'element', (node: Element) => {
    for (const key of ['href', 'src'] as const) {
      const value = node.properties?.[key];
      if (typeof value === 'string') node.properties[key] = defaultUrlTransform(value);
    }
  });
}

/**
 * One line of plain words with at most `code` spans and **bold**, as React elements, or null for anything
 * else. Most of what an agent says is such a sentence, and the full parser costs ~0.5 ms a part: a
 * 2,000-part conversation must render in under a second. Only text the full parser would render the
 * same way takes this path; any other Markdown character sends it to the parser.
 */
export function simpleLine(text: string): ReactNode[] | null {
  if (text.includes('\n') || /^\s|^([#>+=-]|\d+[.)]|\*\s)/.test(text) || /[\\[\]<>!_~|&@]|https?:|www\./i.test(text)) return null;
  const out: ReactNode[] = [];
  const re = /`([^`]+)`|\*\*([^*`\s](?:[^*`]*[^*`\s])?)\*\*/g;
  let last = 0;
  let m: RegExpExecArray | null;
  while ((m = re.exec(text))) {
    const before = text.slice(last, m.index);
    if (/[*`]/.test(before)) return null;
    if (before) out.push(before);
    out.push(m[1] !== undefined ? <code key={m.index}>{m[1]}</code> : <strong key={m.index}>{m[2]}</strong>);
    last = m.index + m[0].length;
  }
  const rest = text.slice(last);
  if (/[*`]/.test(rest)) return null;
  if (rest) out.push(rest);
  return out;
}

export const Markdown = memo(function Markdown({ text }: { text: string }) {
  const simple = simpleLine(text.replace(/\n+$/, ''));
  if (simple) return <div className="md"><p>{simple}</p></div>;
  return <ParsedMarkdown text={text} />;
});

/** Any Markdown, through the parser. */
export function ParsedMarkdown({ text }: { text: string }) {
  const tree = processor.runSync(processor.parse(text)) as Root;
  safeUrls(tree);
  return (
    <div className="md">
      {toJsxRuntime(tree, { Fragment, jsx, jsxs, components: components as never, passNode: false })}
    </div>
  );
}
