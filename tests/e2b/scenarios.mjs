// Scenarios for dsec-e2b, driven by the unmodified E2B JavaScript SDK (e2b, pinned in package.json).
//
//   E2B_API_URL=http://127.0.0.1:PORT E2B_SANDBOX_URL=http://127.0.0.1:PORT E2B_API_KEY=e2b_<40 hex> \
//     node scenarios.mjs NAME [ARGS...]
//
// NAME is one of: basic, files, lifecycle, reconnect-create, reconnect-use ID PID, concurrent [hold], errors, auth.
// tests/integration/test_e2b.py runs them against a real gateway and asserts on what they print.
//
// Every scenario is a list of steps. A step's value (or, for a call that is expected to fail, the error it raised:
// {"error": {"name", "message", ...}}) goes into one JSON object printed as the last line of stdout. A step that
// throws unexpectedly is recorded as {"unexpectedError": {...}} and the scenario goes on where it can; at the end
// each such failure is printed to stderr as "step: ErrorClass: message" and the exit status is 1. Sandboxes a
// scenario created are killed before it exits (but for reconnect-create's, which reconnect-use takes over).
//
// Environment: E2B_TEMPLATE (default bookworm-python), E2B_BAD_API_KEY (auth), SCENARIO_TIMEOUT_MS (a watchdog,
// default 240000: a hung step prints what there is, names the step and exits 2).
import crypto from 'node:crypto'
import readline from 'node:readline'
import {
  Sandbox,
  CommandExitError,
  SandboxError,
  NotFoundError,
  FileNotFoundError,
  SandboxNotFoundError,
  TimeoutError,
  AuthenticationError,
  InvalidArgumentError,
} from 'e2b'

const TEMPLATE = process.env.E2B_TEMPLATE || 'bookworm-python'
const RUN = `${process.pid}-${Date.now().toString(36)}`
const out = { scenario: process.argv[2], run: RUN, template: TEMPLATE }
const failures = []
const created = new Set() // sandbox ids to kill at the end
let current = '(start)'

// ------------------------------------------------------------------------------------------------ helpers

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

function jsonable(v) {
  return JSON.parse(
    JSON.stringify(v, (k, x) => {
      if (x instanceof Sandbox) return { sandboxId: x.sandboxId }
      if (x instanceof Uint8Array) return { bytes: x.length }
      if (typeof x === 'bigint') return String(x)
      return x
    })
  )
}

function errInfo(e) {
  const info = {
    name: e?.name,
    class: e?.constructor?.name,
    message: String(e?.message ?? e),
    is: {
      SandboxError: e instanceof SandboxError,
      NotFoundError: e instanceof NotFoundError,
      FileNotFoundError: e instanceof FileNotFoundError,
      SandboxNotFoundError: e instanceof SandboxNotFoundError,
      TimeoutError: e instanceof TimeoutError,
      AuthenticationError: e instanceof AuthenticationError,
      InvalidArgumentError: e instanceof InvalidArgumentError,
      CommandExitError: e instanceof CommandExitError,
    },
  }
  if (e?.statusCode !== undefined) info.statusCode = e.statusCode
  if (e instanceof CommandExitError) {
    info.exitCode = e.exitCode
    info.error = e.error
    info.stdout = e.stdout
    info.stderr = e.stderr
  }
  return info
}

// Runs one step; its value goes to out[name]. An exception is recorded and the scenario goes on.
async function step(name, fn) {
  current = name
  try {
    const v = await fn()
    out[name] = v === undefined ? null : jsonable(v)
    return v
  } catch (e) {
    out[name] = { unexpectedError: errInfo(e) }
    failures.push(`${name}: ${e?.name ?? 'Error'}: ${e?.message ?? e}`)
    return undefined
  }
}

// A call that may fail: {"returned": value} or {"error": errInfo}.
async function caught(fn) {
  try {
    return { returned: jsonable((await fn()) ?? null) }
  } catch (e) {
    return { error: errInfo(e) }
  }
}

async function create(opts = {}, template = TEMPLATE) {
  const sbx = await Sandbox.create(template, opts)
  created.add(sbx.sandboxId)
  return sbx
}

async function waitFor(pred, timeoutMs, intervalMs = 100) {
  const end = Date.now() + timeoutMs
  let v = await pred()
  while (!v && Date.now() < end) {
    await sleep(intervalMs)
    v = await pred()
  }
  return v
}

const iso = (d) => (d instanceof Date && !isNaN(d) ? d.toISOString() : d === undefined ? null : String(d))

function infoJson(i) {
  return {
    sandboxId: i.sandboxId,
    templateId: i.templateId,
    name: i.name ?? null,
    metadata: i.metadata,
    state: i.state,
    startedAt: iso(i.startedAt),
    endAt: iso(i.endAt),
    cpuCount: i.cpuCount,
    memoryMB: i.memoryMB,
    envdVersion: i.envdVersion,
    // Seconds, from the client's clock: how long the sandbox has left, and how long it had in all.
    secondsLeft: i.endAt instanceof Date ? (i.endAt.getTime() - Date.now()) / 1000 : null,
    lifetime: i.endAt instanceof Date && i.startedAt instanceof Date ? (i.endAt - i.startedAt) / 1000 : null,
  }
}

function entryJson(e) {
  return {
    name: e.name,
    type: e.type,
    path: e.path,
    size: e.size,
    mode: e.mode,
    permissions: e.permissions,
    owner: e.owner,
    group: e.group,
    modifiedTime: iso(e.modifiedTime),
    symlinkTarget: e.symlinkTarget ?? null,
  }
}

const byPath = (a, b) => (a.path < b.path ? -1 : a.path > b.path ? 1 : 0)

async function listIds(query, opts = {}) {
  const p = Sandbox.list({ query, ...opts })
  const ids = []
  while (p.hasNext) {
    for (const i of await p.nextItems()) ids.push(i.sandboxId)
  }
  return ids.sort()
}

const procArgs = (p) => [p.cmd, ...(p.args ?? [])].join(' ')

async function cleanup() {
  const left = [...created]
  created.clear()
  await Promise.all(left.map((id) => Sandbox.kill(id, { requestTimeoutMs: 20_000 }).catch(() => false)))
  return left
}

function finish(status) {
  process.stdout.write(JSON.stringify(out) + '\n')
  for (const f of failures) process.stderr.write(f + '\n')
  process.exit(status ?? (failures.length ? 1 : 0))
}

// ------------------------------------------------------------------------------------------------ basic

async function basic() {
  let sbx
  await step('create', async () => {
    sbx = await create({
      metadata: { scenario: 'basic', run: RUN },
      envs: { FOO: 'foo-create', BAR: 'bar-create' },
      timeoutMs: 300_000,
    })
    return { sandboxId: sbx.sandboxId }
  })
  if (!sbx) return

  await step('echo', async () => {
    const r = await sbx.commands.run('echo hello; echo warn >&2')
    return { stdout: r.stdout, stderr: r.stderr, exitCode: r.exitCode, error: r.error ?? null }
  })

  await step('stream', async () => {
    const events = []
    const t0 = Date.now()
    const r = await sbx.commands.run(
      'for i in 1 2 3 4; do echo out$i; echo err$i >&2; sleep 0.4; done; echo done',
      {
        onStdout: (d) => events.push({ stream: 'stdout', data: d, ms: Date.now() - t0 }),
        onStderr: (d) => events.push({ stream: 'stderr', data: d, ms: Date.now() - t0 }),
      }
    )
    const totalMs = Date.now() - t0
    const outs = events.filter((e) => e.stream === 'stdout')
    const errs = events.filter((e) => e.stream === 'stderr')
    return {
      stdout: r.stdout,
      stderr: r.stderr,
      exitCode: r.exitCode,
      stdoutChunks: outs.map((e) => e.data),
      stderrChunks: errs.map((e) => e.data),
      stdoutMs: outs.map((e) => e.ms),
      totalMs,
    }
  })

  await step('bigOutput', async () => {
    const r = await sbx.commands.run(`python3 -c "import sys; sys.stdout.write('x' * 300000 + '\\n')"`)
    return { length: r.stdout.length, allX: /^x+\n$/.test(r.stdout), exitCode: r.exitCode }
  })

  await step('envs', async () => {
    const a = await sbx.commands.run('echo "$FOO|$BAR|${BAZ:-unset}"')
    const b = await sbx.commands.run('echo "$FOO|$BAR|${BAZ:-unset}"', { envs: { BAR: 'bar-call', BAZ: 'baz-call' } })
    const c = await sbx.commands.run('echo "$FOO|$BAR|${BAZ:-unset}"')
    return { createLevel: a.stdout, perCall: b.stdout, afterPerCall: c.stdout }
  })

  await step('cwd', async () => {
    const tmp = await sbx.commands.run('pwd', { cwd: '/tmp' })
    const dflt = await sbx.commands.run('pwd; echo "$HOME"')
    const made = await sbx.commands.run('mkdir -p /srv/work && cd /srv/work && pwd')
    const srv = await sbx.commands.run('pwd', { cwd: '/srv/work' })
    return { tmp: tmp.stdout, default: dflt.stdout, made: made.stdout, srv: srv.stdout }
  })

  await step('failing', async () =>
    caught(() => sbx.commands.run('echo partial; echo oops >&2; exit 3'))
  )

  await step('timeout', async () => {
    const t0 = Date.now()
    const r = await caught(() => sbx.commands.run('sleep 30', { timeoutMs: 2_000 }))
    const elapsedMs = Date.now() - t0
    let listed = null
    const gone = await waitFor(async () => {
      listed = (await sbx.commands.list()).filter((p) => procArgs(p).includes('sleep 30')).map((p) => p.pid)
      return listed.length === 0
    }, 10_000, 250)
    return { ...r, elapsedMs, goneFromList: !!gone, stillListed: listed }
  })

  await step('background', async () => {
    const h = await sbx.commands.run('sleep 1; echo bg-done', { background: true })
    const whileRunning = await sbx.commands.list()
    const r = await h.wait()
    const afterWait = await sbx.commands.list()
    return {
      pid: h.pid,
      listedWhileRunning: whileRunning.some((p) => p.pid === h.pid),
      listedAfterWait: afterWait.some((p) => p.pid === h.pid),
      stdout: r.stdout,
      exitCode: r.exitCode,
    }
  })

  let sleeper
  await step('list', async () => {
    sleeper = await sbx.commands.run('sleep 60', { background: true, envs: { LISTED: 'yes' }, cwd: '/tmp' })
    const procs = await sbx.commands.list()
    const p = procs.find((x) => x.pid === sleeper.pid)
    return {
      pid: sleeper.pid,
      count: procs.length,
      found: p ? { pid: p.pid, cmd: p.cmd, args: p.args, envs: p.envs, cwd: p.cwd ?? null, tag: p.tag ?? null } : null,
    }
  })

  await step('kill', async () => {
    const killed = await sbx.commands.kill(sleeper.pid)
    const waited = await caught(() => sleeper.wait())
    let listed = true
    await waitFor(async () => {
      listed = (await sbx.commands.list()).some((p) => p.pid === sleeper.pid)
      return !listed
    }, 5_000, 200)
    const unknown = await sbx.commands.kill(999_999)
    const again = await caught(() => sbx.commands.kill(sleeper.pid))
    return { killed, waited, listedAfterKill: listed, killUnknownPid: unknown, killAgain: again }
  })

  await step('stdin', async () => {
    const h = await sbx.commands.run('cat; echo "[cat done]"', { background: true, stdin: true })
    await sbx.commands.sendStdin(h.pid, 'hello\n')
    await sbx.commands.sendStdin(h.pid, 'world\n')
    await sbx.commands.closeStdin(h.pid)
    const r = await Promise.race([
      h.wait(),
      sleep(15_000).then(() => {
        throw new Error('cat did not end within 15 s of closeStdin')
      }),
    ])
    return { pid: h.pid, stdout: r.stdout, exitCode: r.exitCode }
  })

  await step('user', async () => {
    const root = await sbx.commands.run('whoami', { user: 'root' })
    const dflt = await sbx.commands.run('whoami; id -u')
    return { root: root.stdout, default: dflt.stdout }
  })

  await step('kill sandbox', async () => {
    const killed = await sbx.kill()
    created.delete(sbx.sandboxId)
    return killed
  })
}

// ------------------------------------------------------------------------------------------------ files

async function files() {
  let sbx
  await step('create', async () => {
    sbx = await create({ metadata: { scenario: 'files', run: RUN }, timeoutMs: 300_000 })
    return { sandboxId: sbx.sandboxId }
  })
  if (!sbx) return
  const f = () => sbx.files

  await step('writeText', async () => {
    const rel = await f().write('hello.txt', 'hello world\n')
    const abs = await f().write('/tmp/abs.txt', 'absolute ünïcødé ✓\n')
    return { relative: rel, absolute: abs }
  })

  await step('readText', async () => ({
    absolute: await f().read('/root/hello.txt'),
    relative: await f().read('hello.txt'),
    unicode: await f().read('/tmp/abs.txt'),
    viaCommand: (await sbx.commands.run('cat /root/hello.txt')).stdout,
  }))

  await step('bytes', async () => {
    const all = new Uint8Array(512)
    for (let i = 0; i < all.length; i++) all[i] = i % 256
    await f().write('/tmp/bytes.bin', all.buffer)
    const back = await f().read('/tmp/bytes.bin', { format: 'bytes' })
    const big = crypto.randomBytes(1 << 20)
    await f().write('/tmp/big.bin', big.buffer.slice(big.byteOffset, big.byteOffset + big.length))
    const bigBack = Buffer.from(await f().read('/tmp/big.bin', { format: 'bytes' }))
    const sums = (await sbx.commands.run('sha256sum /tmp/bytes.bin /tmp/big.bin')).stdout
    const remote = Object.fromEntries(sums.trim().split('\n').map((l) => l.split(/\s+/).reverse()))
    return {
      length: back.length,
      equal: Buffer.compare(Buffer.from(back), Buffer.from(all)) === 0,
      sha256: crypto.createHash('sha256').update(all).digest('hex'),
      sha256InSandbox: remote['/tmp/bytes.bin'] ?? null,
      bigLength: bigBack.length,
      bigEqual: Buffer.compare(bigBack, big) === 0,
      bigSha256: crypto.createHash('sha256').update(big).digest('hex'),
      bigSha256InSandbox: remote['/tmp/big.bin'] ?? null,
    }
  })

  await step('readMadeByCommand', async () => {
    await sbx.commands.run("printf 'made by bash' > /tmp/fromcmd.txt")
    return await f().read('/tmp/fromcmd.txt')
  })

  await step('writeMultiple', async () => {
    const infos = await f().write([
      { path: '/tmp/tree/a.txt', data: 'A' },
      { path: '/tmp/tree/sub/b.txt', data: 'BB' },
      { path: '/tmp/tree/sub/deeper/c.txt', data: 'CCC' },
    ])
    const check = (await sbx.commands.run('cat /tmp/tree/a.txt /tmp/tree/sub/b.txt /tmp/tree/sub/deeper/c.txt')).stdout
    return { infos, contents: check }
  })

  await step('list', async () => {
    const d1 = (await f().list('/tmp/tree')).map(entryJson).sort(byPath)
    const d2 = (await f().list('/tmp/tree', { depth: 2 })).map(entryJson).sort(byPath)
    const d3 = (await f().list('/tmp/tree', { depth: 3 })).map(entryJson).sort(byPath)
    return { depth1: d1, depth2: d2, depth3: d3 }
  })

  await step('exists', async () => ({
    file: await f().exists('/tmp/tree/a.txt'),
    dir: await f().exists('/tmp/tree/sub'),
    missing: await f().exists('/tmp/tree/nope'),
    missingParent: await f().exists('/nonexistent-dir/x'),
  }))

  await step('getInfo', async () => ({
    file: entryJson(await f().getInfo('/tmp/tree/sub/b.txt')),
    dir: entryJson(await f().getInfo('/tmp/tree/sub')),
    missing: await caught(() => f().getInfo('/tmp/tree/nope')),
  }))

  await step('makeDir', async () => {
    const first = await f().makeDir('/tmp/newdir/inner')
    const second = await f().makeDir('/tmp/newdir/inner')
    const info = entryJson(await f().getInfo('/tmp/newdir/inner'))
    const test = (await sbx.commands.run('test -d /tmp/newdir/inner && echo isdir')).stdout
    return { first, second, type: info.type, viaCommand: test }
  })

  await step('rename', async () => {
    const entry = entryJson(await f().rename('/tmp/tree/a.txt', '/tmp/tree/renamed.txt'))
    return {
      entry,
      oldExists: await f().exists('/tmp/tree/a.txt'),
      newExists: await f().exists('/tmp/tree/renamed.txt'),
      content: await f().read('/tmp/tree/renamed.txt'),
    }
  })

  await step('remove', async () => {
    await f().remove('/tmp/tree')
    await f().remove('/root/hello.txt')
    return {
      dirExists: await f().exists('/tmp/tree'),
      fileExists: await f().exists('/root/hello.txt'),
      viaCommand: (await sbx.commands.run('ls /tmp/tree 2>&1; echo "status $?"')).stdout,
      removeMissing: await caught(() => f().remove('/tmp/never-there')),
    }
  })

  await step('readMissing', async () => caught(() => f().read('/tmp/does-not-exist.txt')))

  await step('watchDir', async () => {
    await f().makeDir('/tmp/watched')
    const events = []
    let exitErr = null
    const h = await f().watchDir('/tmp/watched', (e) => events.push({ name: e.name, type: e.type }), {
      timeoutMs: 60_000,
      onExit: (err) => {
        exitErr = err ? errInfo(err) : null
      },
    })
    await sleep(300)
    await f().write('/tmp/watched/w.txt', 'via files.write')
    const sawWrite = await waitFor(() => events.some((e) => e.name === 'w.txt'), 5_000)
    await sbx.commands.run('echo via-bash > /tmp/watched/v.txt')
    const sawBash = await waitFor(() => events.some((e) => e.name === 'v.txt'), 5_000)
    await h.stop()
    const countAtStop = events.length
    await sleep(500)
    await sbx.commands.run('echo late > /tmp/watched/late.txt')
    await sleep(700)
    return {
      events,
      sawFilesWrite: !!sawWrite,
      sawBashWrite: !!sawBash,
      eventsAfterStop: events.slice(countAtStop),
      onExit: exitErr,
    }
  })

  await step('kill sandbox', async () => {
    const killed = await sbx.kill()
    created.delete(sbx.sandboxId)
    return killed
  })
}

// ------------------------------------------------------------------------------------------------ lifecycle

async function lifecycle() {
  const sbx = {}
  await step('create', async () => {
    const made = await Promise.all(
      ['a', 'b', 'c'].map((role) =>
        create({ metadata: { suite: RUN, role }, timeoutMs: 300_000 }).then((s) => [role, s])
      )
    )
    for (const [role, s] of made) sbx[role] = s
    return Object.fromEntries(made.map(([role, s]) => [role, s.sandboxId]))
  })
  if (!sbx.a || !sbx.b || !sbx.c) return
  const ids = { a: sbx.a.sandboxId, b: sbx.b.sandboxId, c: sbx.c.sandboxId }

  await step('getInfo', async () => infoJson(await sbx.a.getInfo()))
  await step('getInfoStatic', async () => infoJson(await Sandbox.getInfo(ids.b)))

  await step('setTimeout', async () => {
    await sbx.a.setTimeout(150_000)
    return infoJson(await sbx.a.getInfo())
  })

  await step('listByMetadata', async () => ({
    suite: await listIds({ metadata: { suite: RUN } }),
    roleA: await listIds({ metadata: { suite: RUN, role: 'a' } }),
    none: await listIds({ metadata: { suite: RUN, role: 'nobody' } }),
    items: (await Sandbox.list({ query: { metadata: { suite: RUN } } }).nextItems()).map(infoJson),
  }))

  await step('pagination', async () => {
    const p = Sandbox.list({ query: { metadata: { suite: RUN } }, limit: 1 })
    const pages = []
    while (p.hasNext && pages.length < 10) {
      pages.push((await p.nextItems()).map((i) => i.sandboxId))
    }
    return { pages, hasNextAtEnd: p.hasNext }
  })

  let sleeperPid
  await step('prepareState', async () => {
    await sbx.a.files.write('/root/keep.txt', 'kept across pause')
    const h = await sbx.a.commands.run('sleep 1000', { background: true, timeoutMs: 0 })
    sleeperPid = h.pid
    await h.disconnect()
    return { pid: h.pid }
  })

  await step('pause', async () => {
    const first = await sbx.a.pause()
    const info = infoJson(await Sandbox.getInfo(ids.a))
    const second = await caught(() => sbx.a.pause())
    return { first, state: info.state, info, second }
  })

  await step('listByState', async () => ({
    paused: await listIds({ metadata: { suite: RUN }, state: ['paused'] }),
    running: await listIds({ metadata: { suite: RUN }, state: ['running'] }),
    both: await listIds({ metadata: { suite: RUN }, state: ['running', 'paused'] }),
    dflt: await listIds({ metadata: { suite: RUN } }),
  }))

  await step('connectResumes', async () => {
    const t0 = Date.now()
    const again = await Sandbox.connect(ids.a, { timeoutMs: 120_000 })
    const connectMs = Date.now() - t0
    const info = infoJson(await again.getInfo())
    const file = await again.files.read('/root/keep.txt')
    const procs = await again.commands.list()
    const sleeper = procs.find((p) => p.pid === sleeperPid)
    const echo = await again.commands.run('echo resumed')
    return {
      sandboxId: again.sandboxId,
      connectMs,
      state: info.state,
      info,
      file,
      sleeperListed: !!sleeper,
      sleeperArgs: sleeper ? procArgs(sleeper) : null,
      echo: echo.stdout,
    }
  })

  await step('connectRunningKeepsTtl', async () => {
    const before = await Sandbox.getInfo(ids.b)
    const again = await Sandbox.connect(ids.b, { timeoutMs: 30_000 })
    const after = await Sandbox.getInfo(ids.b)
    const echo = await again.commands.run('echo connected')
    return {
      endAtBefore: iso(before.endAt),
      endAtAfter: iso(after.endAt),
      shortenedBySeconds: (before.endAt - after.endAt) / 1000,
      state: after.state,
      echo: echo.stdout,
    }
  })

  await step('kill', async () => {
    const first = await sbx.a.kill()
    const second = await Sandbox.kill(ids.a)
    const unknown = await Sandbox.kill(`nosuchsandbox${RUN.replace(/-/g, '')}`)
    created.delete(ids.a)
    return { first, second, unknown }
  })

  await step('afterKill', async () => ({
    getInfo: await caught(() => Sandbox.getInfo(ids.a)),
    getInfoUnknown: await caught(() => Sandbox.getInfo(`nosuchsandbox${RUN.replace(/-/g, '')}`)),
    list: await listIds({ metadata: { suite: RUN } }),
  }))

  await step('killRest', async () => {
    const r = { b: await sbx.b.kill(), c: await Sandbox.kill(ids.c) }
    created.delete(ids.b)
    created.delete(ids.c)
    r.listAfter = await listIds({ metadata: { suite: RUN } })
    return r
  })
}

// ------------------------------------------------------------------------------------------------ reconnect

const TICKER = 'for i in $(seq 1 1000); do echo tick $i; sleep 0.3; done'

async function reconnectCreate() {
  let sbx
  await step('create', async () => {
    sbx = await create({ metadata: { scenario: 'reconnect', run: RUN }, timeoutMs: 300_000 })
    return { sandboxId: sbx.sandboxId }
  })
  if (!sbx) return
  out.sandboxId = sbx.sandboxId
  await step('write', async () => sbx.files.write('/root/state.txt', `written by ${RUN}`))
  await step('ticker', async () => {
    let text = ''
    const h = await sbx.commands.run(TICKER, { background: true, timeoutMs: 0, onStdout: (d) => (text += d) })
    out.pid = h.pid
    await waitFor(() => /tick 2\n/.test(text), 10_000)
    await h.disconnect()
    const ticks = [...text.matchAll(/tick (\d+)/g)].map((m) => Number(m[1]))
    return { pid: h.pid, lastTickSeen: ticks.length ? ticks[ticks.length - 1] : null }
  })
  // The sandbox is reconnect-use's to take over (and kill), unless this scenario failed.
  if (!failures.length) created.delete(sbx.sandboxId)
}

async function reconnectUse(id, pid) {
  let sbx
  out.sandboxId = id
  out.pid = pid
  await step('connect', async () => {
    sbx = await Sandbox.connect(id)
    created.add(id)
    return { sandboxId: sbx.sandboxId }
  })
  if (!sbx) return
  await step('read', async () => sbx.files.read('/root/state.txt'))
  await step('list', async () => {
    const p = (await sbx.commands.list()).find((x) => x.pid === pid)
    return p ? { pid: p.pid, cmd: p.cmd, args: p.args } : null
  })
  await step('connectProcess', async () => {
    let text = ''
    const h = await sbx.commands.connect(pid, { timeoutMs: 0, onStdout: (d) => (text += d) })
    await waitFor(() => (text.match(/tick \d+\n/g) ?? []).length >= 3, 10_000)
    const killed = await sbx.commands.kill(pid)
    const waited = await caught(() =>
      Promise.race([h.wait(), sleep(10_000).then(() => Promise.reject(new Error('no end within 10 s of kill')))])
    )
    const ticks = [...text.matchAll(/tick (\d+)/g)].map((m) => Number(m[1]))
    return { handlePid: h.pid, ticks, killed, waited }
  })
  await step('listAfterKill', async () => (await sbx.commands.list()).some((p) => p.pid === pid))
  await step('kill sandbox', async () => {
    const killed = await sbx.kill()
    created.delete(id)
    return killed
  })
}

// ------------------------------------------------------------------------------------------------ concurrent

async function concurrent(hold) {
  const N = 8
  const sbxs = []
  await step('create', async () => {
    const t0 = Date.now()
    const settled = await Promise.allSettled(
      Array.from({ length: N }, (_, i) =>
        create({ metadata: { scenario: 'concurrent', run: RUN, index: String(i) }, timeoutMs: 300_000 })
      )
    )
    const errors = []
    settled.forEach((s, i) => (s.status === 'fulfilled' ? sbxs.push([i, s.value]) : errors.push(errInfo(s.reason))))
    if (errors.length) throw new Error(`${errors.length} of ${N} creates failed: ${JSON.stringify(errors)}`)
    return { ms: Date.now() - t0, ids: sbxs.map(([, s]) => s.sandboxId) }
  })
  await step('commands', async () => {
    const rs = await Promise.all(sbxs.map(([i, s]) => s.commands.run(`echo sandbox-${i}; hostname`)))
    return rs.map((r, k) => {
      const [line, hostname] = r.stdout.trim().split('\n')
      return { sandboxId: sbxs[k][1].sandboxId, line, hostname, exitCode: r.exitCode }
    })
  })
  await step('listed', async () => listIds({ metadata: { run: RUN } }))
  if (hold) {
    // Lets the caller look at the nodes while the sandboxes live: one JSON line now, then a line on stdin.
    process.stdout.write(JSON.stringify({ hold: true, ...out }) + '\n')
    const rl = readline.createInterface({ input: process.stdin })
    await new Promise((r) => {
      rl.once('line', r)
      rl.once('close', r)
    })
    rl.close()
  }
  await step('kill', async () => {
    const r = await Promise.all(sbxs.map(([, s]) => s.kill()))
    for (const [, s] of sbxs) created.delete(s.sandboxId)
    return r
  })
  await step('listedAfterKill', async () => listIds({ metadata: { run: RUN } }))
}

// ------------------------------------------------------------------------------------------------ errors

async function errors() {
  const unknownTemplate = `no-such-template-${RUN}`
  out.unknownTemplateName = unknownTemplate
  await step('unknownTemplate', async () => {
    const r = await caught(() => create({ timeoutMs: 60_000 }, unknownTemplate))
    return r
  })
  const unknownId = `nosuchsandbox${RUN.replace(/-/g, '')}`
  out.unknownId = unknownId
  await step('connectUnknown', async () => caught(() => Sandbox.connect(unknownId)))
  await step('getInfoUnknown', async () => caught(() => Sandbox.getInfo(unknownId)))
  await step('killUnknown', async () => caught(() => Sandbox.kill(unknownId)))
  await step('setTimeoutUnknown', async () => caught(() => Sandbox.setTimeout(unknownId, 60_000)))
  await step('useAfterKill', async () => {
    const sbx = await create({ metadata: { scenario: 'errors', run: RUN }, timeoutMs: 120_000 })
    await sbx.kill()
    created.delete(sbx.sandboxId)
    return {
      run: await caught(() => sbx.commands.run('echo still-here')),
      read: await caught(() => sbx.files.read('/etc/hostname')),
      isRunning: await caught(() => sbx.isRunning()),
    }
  })
}

// ------------------------------------------------------------------------------------------------ auth

async function auth() {
  const bad = process.env.E2B_BAD_API_KEY || 'e2b_' + 'f'.repeat(40)
  let sbx
  await step('goodCreate', async () => {
    sbx = await create({ metadata: { scenario: 'auth', run: RUN }, timeoutMs: 120_000 })
    return { sandboxId: sbx.sandboxId }
  })
  await step('goodRun', async () => (await sbx.commands.run('echo authorized')).stdout)
  await step('badList', async () => caught(() => Sandbox.list({ apiKey: bad }).nextItems()))
  await step('badCreate', async () => {
    const r = await caught(() => create({ apiKey: bad, timeoutMs: 60_000 }))
    return r
  })
  await step('badGetInfo', async () => caught(() => Sandbox.getInfo(sbx.sandboxId, { apiKey: bad })))
  await step('badKill', async () => caught(() => Sandbox.kill(sbx.sandboxId, { apiKey: bad })))
  await step('badConnect', async () => caught(() => Sandbox.connect(sbx.sandboxId, { apiKey: bad })))
  await step('stillRunning', async () => (await sbx.getInfo()).state)
  // The data plane without the sandbox's envd access token (what the SDK sends as X-Access-Token).
  await step('envdWithoutToken', async () => {
    const base = process.env.E2B_SANDBOX_URL
    const r = await fetch(`${base}/files?path=${encodeURIComponent('/etc/hostname')}`, {
      headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49983' },
    })
    return { status: r.status, body: (await r.text()).slice(0, 200) }
  })
  await step('envdWrongToken', async () => {
    const base = process.env.E2B_SANDBOX_URL
    const r = await fetch(`${base}/files?path=${encodeURIComponent('/etc/hostname')}`, {
      headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49983', 'X-Access-Token': 'wrong' },
    })
    return { status: r.status, body: (await r.text()).slice(0, 200) }
  })
  await step('goodKill', async () => {
    const killed = await sbx.kill()
    created.delete(sbx.sandboxId)
    return killed
  })
}

// ------------------------------------------------------------------------------------------------ main

const scenarios = {
  basic,
  files,
  lifecycle,
  'reconnect-create': reconnectCreate,
  'reconnect-use': () => reconnectUse(process.argv[3], Number(process.argv[4])),
  concurrent: () => concurrent(process.argv[3] === 'hold'),
  errors,
  auth,
}

const name = process.argv[2]
if (!scenarios[name]) {
  process.stderr.write(`usage: node scenarios.mjs {${Object.keys(scenarios).join('|')}} [args]\n`)
  process.exit(64)
}

const watchdog = setTimeout(async () => {
  failures.push(`${current}: Watchdog: scenario ${name} still in step '${current}' after the timeout`)
  out.watchdog = current
  out.leftover = await Promise.race([cleanup(), sleep(20_000).then(() => 'cleanup timed out')])
  finish(2)
}, Number(process.env.SCENARIO_TIMEOUT_MS || 240_000))

try {
  await scenarios[name]()
} catch (e) {
  failures.push(`${current}: ${e?.name ?? 'Error'}: ${e?.message ?? e}`)
}
current = '(cleanup)'
const left = await cleanup()
if (left.length) out.leftover = left
finish()
