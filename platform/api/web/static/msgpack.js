// A small msgpack codec for the page: the invoke and job endpoints speak msgpack only.
// Encodes null, booleans, numbers (integers up to 2^53 as ints, others as float64), strings,
// Uint8Array (bin), arrays and plain objects; decodes everything those produce plus the
// other fixed-size forms a server may use. No extension types.
"use strict";

const msgpack = (() => {
  const utf8 = new TextEncoder();
  const utf8d = new TextDecoder();

  function encode(value) {
    const parts = [];
    let size = 0;
    const push = (bytes) => { parts.push(bytes); size += bytes.length; };
    const header = (...bytes) => push(Uint8Array.of(...bytes));
    const u16 = (tag, n) => { const b = new Uint8Array(3); b[0] = tag; new DataView(b.buffer).setUint16(1, n); push(b); };
    const u32 = (tag, n) => { const b = new Uint8Array(5); b[0] = tag; new DataView(b.buffer).setUint32(1, n); push(b); };

    function length(n, fix, fixMax, t8, t16, t32) {
      if (fix !== null && n <= fixMax) header(fix | n);
      else if (t8 !== null && n < 0x100) header(t8, n);
      else if (n < 0x10000) u16(t16, n);
      else u32(t32, n);
    }

    function int(n) {
      if (n >= 0) {
        if (n < 0x80) header(n);
        else if (n < 0x100) header(0xcc, n);
        else if (n < 0x10000) u16(0xcd, n);
        else if (n < 0x100000000) u32(0xce, n);
        else { const b = new Uint8Array(9); b[0] = 0xcf; new DataView(b.buffer).setBigUint64(1, BigInt(n)); push(b); }
      } else {
        if (n >= -32) header(0xe0 | (n + 32));
        else { const b = new Uint8Array(9); b[0] = 0xd3; new DataView(b.buffer).setBigInt64(1, BigInt(n)); push(b); }
      }
    }

    function go(v) {
      if (v === null || v === undefined) header(0xc0);
      else if (v === false) header(0xc2);
      else if (v === true) header(0xc3);
      else if (typeof v === "number") {
        if (Number.isSafeInteger(v)) int(v);
        else { const b = new Uint8Array(9); b[0] = 0xcb; new DataView(b.buffer).setFloat64(1, v); push(b); }
      } else if (typeof v === "string") {
        const bytes = utf8.encode(v);
        length(bytes.length, 0xa0, 31, 0xd9, 0xda, 0xdb);
        push(bytes);
      } else if (v instanceof Uint8Array) {
        length(v.length, null, 0, 0xc4, 0xc5, 0xc6);
        push(v);
      } else if (Array.isArray(v)) {
        length(v.length, 0x90, 15, null, 0xdc, 0xdd);
        v.forEach(go);
      } else if (typeof v === "object") {
        const keys = Object.keys(v).filter((k) => v[k] !== undefined);
        length(keys.length, 0x80, 15, null, 0xde, 0xdf);
        for (const k of keys) { go(k); go(v[k]); }
      } else throw new TypeError(`msgpack: cannot encode ${typeof v}`);
    }

    go(value);
    const out = new Uint8Array(size);
    let at = 0;
    for (const p of parts) { out.set(p, at); at += p.length; }
    return out;
  }

  function decode(buffer) {
    const bytes = buffer instanceof Uint8Array ? buffer : new Uint8Array(buffer);
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    let at = 0;
    const str = (n) => { const s = utf8d.decode(bytes.subarray(at, at + n)); at += n; return s; };
    const bin = (n) => { const b = bytes.slice(at, at + n); at += n; return b; };
    const arr = (n) => { const a = []; for (let i = 0; i < n; i++) a.push(go()); return a; };
    const map = (n) => { const o = {}; for (let i = 0; i < n; i++) { const k = go(); o[k] = go(); } return o; };
    const u8 = () => view.getUint8(at++);
    const u16 = () => { const v = view.getUint16(at); at += 2; return v; };
    const u32 = () => { const v = view.getUint32(at); at += 4; return v; };

    function go() {
      const t = u8();
      if (t < 0x80) return t;
      if (t < 0x90) return map(t & 0x0f);
      if (t < 0xa0) return arr(t & 0x0f);
      if (t < 0xc0) return str(t & 0x1f);
      if (t >= 0xe0) return t - 0x100;
      switch (t) {
        case 0xc0: return null;
        case 0xc2: return false;
        case 0xc3: return true;
        case 0xc4: return bin(u8());
        case 0xc5: return bin(u16());
        case 0xc6: return bin(u32());
        case 0xca: { const v = view.getFloat32(at); at += 4; return v; }
        case 0xcb: { const v = view.getFloat64(at); at += 8; return v; }
        case 0xcc: return u8();
        case 0xcd: return u16();
        case 0xce: return u32();
        case 0xcf: { const v = view.getBigUint64(at); at += 8; return Number(v); }
        case 0xd0: { const v = view.getInt8(at); at += 1; return v; }
        case 0xd1: { const v = view.getInt16(at); at += 2; return v; }
        case 0xd2: { const v = view.getInt32(at); at += 4; return v; }
        case 0xd3: { const v = view.getBigInt64(at); at += 8; return Number(v); }
        case 0xd9: return str(u8());
        case 0xda: return str(u16());
        case 0xdb: return str(u32());
        case 0xdc: return arr(u16());
        case 0xdd: return arr(u32());
        case 0xde: return map(u16());
        case 0xdf: return map(u32());
        default: throw new Error(`msgpack: unsupported type 0x${t.toString(16)}`);
      }
    }
    return go();
  }

  return { encode, decode };
})();
