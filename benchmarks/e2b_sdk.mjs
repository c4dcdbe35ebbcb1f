// The E2B SDK's side of benchmarks/e2b_sdk.py: the official SDK, unchanged, against a dsec-e2b gateway
// (E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY in the environment).
//
//   node e2b_sdk.mjs latency TEMPLATE N WARMUP   create, then the first command (`true`), N times; kill untimed
//   node e2b_sdk.mjs rate TEMPLATE C SECONDS     C workers create then kill for SECONDS; creates that completed
//   node e2b_sdk.mjs loop TEMPLATE STEPS THINK   an agent loop: a command after each THINK ms in one sandbox
//
// Prints one JSON line.
import { Sandbox } from 'e2b'

const [mode, template, a, b] = process.argv.slice(2)
const ms = (t0) => Number(process.hrtime.bigint() - t0) / 1e6

if (mode === 'latency') {
  const n = Number(a), warmup = Number(b)
  const create = [], first = [], total = []
  for (let i = 0; i < warmup + n; i++) {
    const t0 = process.hrtime.bigint()
    const sbx = await Sandbox.create(template, { timeoutMs: 300_000 })
    const created = ms(t0)
    const t1 = process.hrtime.bigint()
    const r = await sbx.commands.run('true')
    const ran = ms(t1)
    if (r.exitCode !== 0) throw new Error(`true exited ${r.exitCode}`)
    await sbx.kill()
    if (i >= warmup) {
      create.push(created)
      first.push(ran)
      total.push(created + ran)
    }
  }
  console.log(JSON.stringify({ create, first, total }))
} else if (mode === 'rate') {
  const c = Number(a), seconds = Number(b)
  const end = Date.now() + seconds * 1000
  let completed = 0
  const latencies = []
  await Promise.all(Array.from({ length: c }, async () => {
    while (Date.now() < end) {
      const t0 = process.hrtime.bigint()
      const sbx = await Sandbox.create(template, { timeoutMs: 300_000 })
      if (Date.now() <= end) {
        completed++
        latencies.push(ms(t0))
      }
      await sbx.kill()
    }
  }))
  console.log(JSON.stringify({ completed, seconds, latencies }))
} else if (mode === 'loop') {
  // An agent loop: one sandbox, a step (a command) after each think time.
  const steps = Number(a), thinkMs = Number(b)
  const sbx = await Sandbox.create(template, { timeoutMs: 300_000 })
  const step = []
  for (let i = 0; i < steps + 3; i++) {
    await new Promise((r) => setTimeout(r, thinkMs))
    const t0 = process.hrtime.bigint()
    const r = await sbx.commands.run(`echo step ${i}`)
    if (r.stdout !== `step ${i}\n`) throw new Error(`step ${i}: ${JSON.stringify(r)}`)
    if (i >= 3) step.push(ms(t0))
  }
  await sbx.kill()
  console.log(JSON.stringify({ step }))
} else {
  console.error('usage: e2b_sdk.mjs latency TEMPLATE N WARMUP | rate TEMPLATE C SECONDS | loop TEMPLATE STEPS THINK_MS')
  process.exit(2)
}
