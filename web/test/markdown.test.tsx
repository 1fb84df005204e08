// Agent text as GitHub-flavoured Markdown, sanitised.
import { cleanup, render } from '@testing-library/react';
import { afterEach, describe, expect, it } from 'vitest';
import { Markdown, ParsedMarkdown, simpleLine } from '../src/markdown';

afterEach(cleanup);

describe('markdown', () => {
  it('renders GFM: headings above body text, tables, task lists, strikethrough, highlighted code', () => {
    const text = [
      '# Summary', '', 'Done ~~maybe~~ surely.', '',
      '| file | change |', '| --- | --- |', '| `a.rs` | +3 |', '',
      '- [x] write the fix', '- [ ] ask for review', '',
      '```rust', 'fn main() { let x = 1; }', '```',
    ].join('\n');
    const { container } = render(<Markdown text={text} />);
    expect(container.querySelector('h3')?.textContent).toBe('Summary');
    expect(container.querySelector('del')?.textContent).toBe('maybe');
    expect([...container.querySelectorAll('table td')].map((td) => td.textContent)).toEqual(['a.rs', '+3']);
    const boxes = [...container.querySelectorAll('input[type=checkbox]')] as HTMLInputElement[];
    expect(boxes.map((b) => [b.checked, b.disabled])).toEqual([[true, true], [false, true]]);
    const code = container.querySelector('pre code.language-rust');
    expect(code?.textContent).toBe('fn main() { let x = 1; }');
    expect(code?.querySelector('.hljs-keyword')?.textContent).toBe('fn');
  });

  it('never renders raw HTML or a script link', () => {
    const { container } = render(<Markdown text={'<img src=x onerror="alert(1)"> <script>alert(2)</script>\n\n[click](javascript:alert(3)) [ok](https://example.com)'} />);
    expect(container.querySelector('img, script')).toBeNull();
    const links = [...container.querySelectorAll('a')];
    expect(links.map((a) => a.getAttribute('href'))).toEqual(['', 'https://example.com']);
    expect(links[1].getAttribute('rel')).toBe('noreferrer noopener');
  });

  it('renders a plain sentence the way the full parser does, without it', () => {
    for (const text of ['Part 1 with `code` and **bold**.', 'Just words.', '`a` then `b`', '**all bold**']) {
      const fast = render(<Markdown text={text} />).container.innerHTML;
      cleanup();
      const full = render(<ParsedMarkdown text={text} />).container.innerHTML;
      cleanup();
      expect(fast, text).toBe(full);
    }
    for (const text of ['a * b', '**a **b**', 'x_y_z', 'see https://x.dev', '# h', '- item', 'a\nb', '1. one', '`un closed']) {
      expect(simpleLine(text), text).toBeNull();
    }
  });

  it('keeps a code block of an unknown language as plain text', () => {
    const { container } = render(<Markdown text={'```brainfuck\n+++.\n```'} />);
    expect(container.querySelector('pre code')?.textContent).toBe('+++.\n');
  });
});
