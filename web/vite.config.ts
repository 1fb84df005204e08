import { gzipSync } from 'node:zlib';
import { defineConfig } from 'vite';

// Every text file of the build gets a gzip twin (`name.gz`), which sortie serves to browsers that
// accept gzip: compressed once here, never per request.
const gzipTwins = {
  name: 'sortie-gzip-twins',
  apply: 'build',
  enforce: 'post',
  generateBundle(_options: unknown, bundle: Record<string, { type: string; code?: string; source?: string | Uint8Array }>) {
    for (const [fileName, file] of Object.entries(bundle)) {
      if (!/\.(js|css|html|svg|json)$/.test(fileName)) continue;
      const source = file.type === 'chunk' ? file.code! : file.source!;
      (this as unknown as { emitFile(f: object): void }).emitFile({
        type: 'asset', fileName: `${fileName}.gz`, source: gzipSync(source, { level: 9 }),
      });
    }
  },
};

// No React plugin: JSX is compiled by Vite's own transform with the automatic runtime.
export default defineConfig({
  plugins: [gzipTwins],
  oxc: { jsx: { runtime: 'automatic' } },
  build: { target: 'es2022', sourcemap: false, chunkSizeWarningLimit: 600 },
  server: { proxy: { '/v1': 'http://127.0.0.1:8080' } },
  test: { environment: 'jsdom', include: ['test/**/*.test.tsx', 'test/**/*.test.ts'] },
} as never);
