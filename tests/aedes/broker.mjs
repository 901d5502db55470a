// An aedes MQTT broker (MQTT 3.1/3.1.1 only) for the fleet tests: tests/brokers.py starts it with
//   node broker.mjs NODE_MODULES_DIR PORT [REDIS_PORT]
// NODE_MODULES_DIR: where scripts/test.sh ran `npm ci` for package.json beside this file (in the cache,
// not the checkout), so the packages are loaded from there by path.
// Alone, it keeps everything in memory (aedes' default persistence and emitter). With REDIS_PORT, its
// retained messages, sessions and subscriptions live in Redis (aedes-persistence-redis) and its
// messages go through Redis pub/sub (mqemitter-redis), so two or more of these on one Redis are a
// cluster: a client of either node sees what a client of the other published and retained.
import net from 'node:net'
import { createRequire } from 'node:module'
import { pathToFileURL } from 'node:url'

const from = createRequire(process.argv[2].replace(/\/?$/, '/'))
const load = async (name) => import(pathToFileURL(from.resolve(name)).href)
const { Aedes } = await load('aedes')
const port = Number(process.argv[3])
const redisPort = process.argv[4] ? Number(process.argv[4]) : null
const opts = {}
if (redisPort) {
  const persistence = (await load('aedes-persistence-redis')).default
  const emitter = (await load('mqemitter-redis')).default
  opts.persistence = persistence({ host: '127.0.0.1', port: redisPort, family: 4 })
  opts.mq = emitter({ host: '127.0.0.1', port: redisPort, family: 4 })
}
const broker = await Aedes.createBroker(opts)
if (redisPort) {
  // aedes drops, per client, a message from another node whose brokerCounter is below the last one it
  // forwarded from that node (its cross-node "dedupe"); a node emits its publishes out of counter order
  // when its Redis writes finish out of order, so a subscriber of many devices lost messages (1 device in
  // 5 of a rollout waited forever for its verdict). Without it a message may come twice: QoS 1 allows that.
  broker.on('client', (client) => { client.duplicates = new Proxy({}, { get: () => 0, set: () => true }) })
}
broker.on('clientError', (client, err) => console.error('client error', client && client.id, err.message))
const server = net.createServer(broker.handle)
server.listen(port, '127.0.0.1', () => console.log(`aedes listening on ${port}` + (redisPort ? ` redis ${redisPort}` : '')))
const stop = () => server.close(() => broker.close(() => process.exit(0)))
process.on('SIGTERM', stop)
process.on('SIGINT', stop)
