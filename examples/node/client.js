// Calling the vaccel broker from Node (docs/api.md): get an identity token, ask Status,
// take one device with TryAcquire, heartbeat it once and Release it.
//
//   npm ci --prefix examples/node          # once (scripts/setup.sh does it)
//   node examples/node/client.js           # the broker from VACCEL_SOCKET, else /run/vaccel/brokerd.sock
//
// Prints one JSON line: {"devices": N, "lease": "l-...", "released": "released", ...}.
// VACCEL_PROTO names broker.proto when this file is not in a vaccel checkout
// (an installed vaccel has it in <prefix>/share/vaccel/proto/vaccel/v1/broker.proto).
"use strict";

const fs = require("fs");
const net = require("net");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const SOCKET = process.env.VACCEL_SOCKET || "/run/vaccel/brokerd.sock";
const TOKEN_KEY = "vaccel-token"; // the metadata key every call carries (vaccel_common/auth.py)

function protoPath() {
  const candidates = [
    process.env.VACCEL_PROTO,
    path.join(__dirname, "..", "..", "proto", "vaccel", "v1", "broker.proto"),
    "/usr/local/share/vaccel/proto/vaccel/v1/broker.proto",
    "/usr/share/vaccel/proto/vaccel/v1/broker.proto",
  ].filter(Boolean);
  const found = candidates.find((p) => fs.existsSync(p));
  if (!found) throw new Error(`broker.proto not found (looked in ${candidates.join(", ")}); set VACCEL_PROTO`);
  return found;
}

// The token: connect to the side socket `<socket>.id`; the daemon reads this process's
// uid and pid from the kernel (SO_PEERCRED) and answers one JSON line. The token is bound
// to this process: every call from it carries the token until `expires` (unix time).
function identityToken(socket) {
  return new Promise((resolve, reject) => {
    const conn = net.createConnection(`${socket}.id`);
    let text = "";
    conn.setEncoding("utf8");
    conn.on("data", (chunk) => {
      text += chunk;
      const end = text.indexOf("\n");
      if (end < 0) return;
      conn.destroy(); // one line only: the rest of this connection serves other calls
      const reply = JSON.parse(text.slice(0, end));
      if (reply.error) reject(new Error(`the broker could not identify this process: ${reply.error}`));
      else resolve(reply);
    });
    conn.on("error", reject);
  });
}

function unary(client, method, request, metadata) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: Date.now() + 10000 }, (err, reply) =>
      err ? reject(new Error(`${method}: ${err.details || err.message}`)) : resolve(reply));
  });
}

async function main() {
  const definition = protoLoader.loadSync(protoPath(), { keepCase: true, longs: Number, defaults: true, oneofs: true });
  const { Broker } = grpc.loadPackageDefinition(definition).vaccel.v1;
  const client = new Broker(`unix:${SOCKET}`, grpc.credentials.createInsecure());
  try {
    const { token, uid, pid } = await identityToken(SOCKET);
    const metadata = new grpc.Metadata();
    metadata.set(TOKEN_KEY, token);

    const status = await unary(client, "Status", {}, metadata);
    const update = await unary(client, "TryAcquire", { gpus: 1, command: "node examples/node/client.js" }, metadata);
    if (update.update !== "granted") {
      throw new Error(`no device free: ${update.queued.message}`); // Acquire (a stream) would wait
    }
    const lease = update.granted;
    // A lease lives while its holder heartbeats (every heartbeat_interval_s) or until released.
    await unary(client, "Heartbeat", { lease_id: lease.id }, metadata);
    const released = await unary(client, "Release", { lease_id: lease.id }, metadata);
    console.log(JSON.stringify({
      uid, pid, devices: status.devices.length, lease: lease.id,
      leased: lease.devices.map((d) => d.uuid), held_by: lease.holder.pid, released: released.state,
    }));
  } finally {
    client.close();
  }
}

main().catch((err) => {
  console.error(`vaccel example: ${err.message}`);
  process.exit(1);
});
