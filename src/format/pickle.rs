//! A protocol-2 pickle emitter for the two pickles a DCP checkpoint holds: each item's `data.pkl`
//! (read by torch's weights-only unpickler, so only protocol-2 opcodes) and the `.metadata` file
//! (read by plain `pickle.load`).
//!
//! Opcode choice follows CPython's `pickle._Pickler` at protocol 2 (the pickler torch.save uses,
//! `torch.serialization.DEFAULT_PROTOCOL = 2`), including its memo: every global, string and
//! non-empty tuple is followed by `BINPUT`/`LONG_BINPUT`. Source of the allowed opcode set:
//! `torch/_weights_only_unpickler.py` (torch 2.4.1 and 2.15.0).

use std::collections::HashMap;

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const GLOBAL: u8 = b'c';
const BINPUT: u8 = b'q';
const LONG_BINPUT: u8 = b'r';
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const BINUNICODE: u8 = b'X';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const EMPTY_TUPLE: u8 = b')';
const EMPTY_LIST: u8 = b']';
const EMPTY_DICT: u8 = b'}';
const APPENDS: u8 = b'e';
const SETITEMS: u8 = b'u';
const BUILD: u8 = b'b';
const REDUCE: u8 = b'R';
const NEWOBJ: u8 = 0x81;
const BINPERSID: u8 = b'Q';

/// FxHash (rustc's hasher) for the memo of strings and the merge's key index: several times faster
/// than the default SipHash on the short strings hashed millions of times there (fqns, file names).
/// Those strings are the checkpoint's own key names, so flooding resistance buys nothing.
#[derive(Clone, Copy, Default)]
pub struct FxHasher(u64);

const FX_K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl std::hash::Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.add(u64::from_le_bytes(w.try_into().unwrap()));
        }
        for &b in words.remainder() {
            self.add(b as u64);
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(FX_K);
    }
}

/// `HashMap<K, V, FxBuildHasher>`: see [`FxHasher`].
pub type FxBuildHasher = std::hash::BuildHasherDefault<FxHasher>;

/// Appends pickle opcodes to a byte buffer.
///
/// `put()` memoizes the value just emitted, as CPython does; `global()` and `str()` reuse earlier
/// memo entries (`BINGET`) when `reuse` is on, which keeps a `.metadata` with millions of chunks
/// small. `data.pkl` is emitted with `reuse` off, mirroring a pickler that sees each object once.
pub struct Pickler {
    pub(crate) buf: Vec<u8>,
    next_memo: u32,
    reuse: bool,
    strings: HashMap<String, u32, FxBuildHasher>,
    // Few distinct globals appear (about 15 in a `.metadata`): a linear scan beats hashing.
    globals: Vec<(String, String, u32)>,
}

impl Pickler {
    /// A protocol-2 pickle; `reuse` turns on `BINGET` for repeated globals and strings.
    pub fn new(reuse: bool) -> Self {
        let mut p = Pickler {
            buf: Vec::with_capacity(256),
            next_memo: 0,
            reuse,
            strings: HashMap::default(),
            globals: Vec::new(),
        };
        p.buf.extend_from_slice(&[PROTO, 2]);
        p
    }

    /// Ends the pickle (`STOP`) and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.buf.push(STOP);
        self.buf
    }

    /// Memoizes the value on top of the stack; returns its memo index.
    pub fn put(&mut self) -> u32 {
        let idx = self.next_memo;
        self.next_memo += 1;
        if idx < 256 {
            self.buf.extend_from_slice(&[BINPUT, idx as u8]);
        } else {
            self.buf.push(LONG_BINPUT);
            self.buf.extend_from_slice(&idx.to_le_bytes());
        }
        idx
    }

    /// `BINGET` of memo entry `idx`.
    pub fn get(&mut self, idx: u32) {
        if idx < 256 {
            self.buf.extend_from_slice(&[BINGET, idx as u8]);
        } else {
            self.buf.push(LONG_BINGET);
            self.buf.extend_from_slice(&idx.to_le_bytes());
        }
    }

    /// `GLOBAL module\nname\n`, memoized.
    pub fn global(&mut self, module: &str, name: &str) {
        self.global_idx(module, name);
    }

    /// [`Pickler::global`] for a global emitted many times: `slot` keeps its memo index after the
    /// first call, so later ones are a `BINGET` without a lookup (the same bytes).
    pub fn global_in(&mut self, slot: &mut Option<u32>, module: &str, name: &str) {
        match *slot {
            Some(idx) if self.reuse => self.get(idx),
            _ => *slot = Some(self.global_idx(module, name)),
        }
    }

    /// [`Pickler::global`]; returns the global's memo index.
    fn global_idx(&mut self, module: &str, name: &str) -> u32 {
        if self.reuse {
            if let Some(&(_, _, idx)) = self
                .globals
                .iter()
                // Names first: they mostly differ in length, the modules mostly do not.
                .find(|(m, n, _)| n == name && m == module)
            {
                self.get(idx);
                return idx;
            }
        }
        self.buf.push(GLOBAL);
        self.buf.extend_from_slice(module.as_bytes());
        self.buf.push(b'\n');
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(b'\n');
        let idx = self.put();
        if self.reuse {
            self.globals
                .push((module.to_string(), name.to_string(), idx));
        }
        idx
    }

    /// `BINUNICODE` (u32 length + UTF-8), memoized.
    pub fn str(&mut self, s: &str) {
        self.str_idx(s);
    }

    /// [`Pickler::str`] for a string emitted many times: `slot` keeps its memo index after the
    /// first call, so later ones are a `BINGET` without hashing the string (the same bytes: a
    /// string's memo index never changes once it has one).
    pub fn str_in(&mut self, slot: &mut Option<u32>, s: &str) {
        match *slot {
            Some(idx) if self.reuse => self.get(idx),
            _ => *slot = Some(self.str_idx(s)),
        }
    }

    /// [`Pickler::str`]; returns the string's memo index.
    fn str_idx(&mut self, s: &str) -> u32 {
        if self.reuse {
            if let Some(&idx) = self.strings.get(s) {
                self.get(idx);
                return idx;
            }
        }
        self.buf.push(BINUNICODE);
        self.buf.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(s.as_bytes());
        let idx = self.put();
        if self.reuse {
            self.strings.insert(s.to_string(), idx);
        }
        idx
    }

    /// An int with CPython's choice of opcode: BININT1, BININT2, BININT or LONG1.
    pub fn int(&mut self, v: i128) {
        if (0..=0xff).contains(&v) {
            self.buf.extend_from_slice(&[BININT1, v as u8]);
        } else if (0..=0xffff).contains(&v) {
            self.buf.push(BININT2);
            self.buf.extend_from_slice(&(v as u16).to_le_bytes());
        } else if (i32::MIN as i128..=i32::MAX as i128).contains(&v) {
            self.buf.push(BININT);
            self.buf.extend_from_slice(&(v as i32).to_le_bytes());
        } else {
            // LONG1: little-endian two's complement, shortest form (pickle.encode_long).
            let bytes = v.to_le_bytes();
            let mut n = 16;
            while n > 1 {
                let top = bytes[n - 1];
                let next_sign = bytes[n - 2] & 0x80;
                if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.buf.extend_from_slice(&[LONG1, n as u8]);
            self.buf.extend_from_slice(&bytes[..n]);
        }
    }

    /// `NONE`.
    pub fn none(&mut self) {
        self.buf.push(NONE);
    }

    /// `BINFLOAT`: the IEEE double, big-endian (CPython's opcode for every float).
    pub fn float(&mut self, v: f64) {
        self.buf.push(BINFLOAT);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    /// `NEWTRUE` / `NEWFALSE`.
    pub fn bool(&mut self, v: bool) {
        self.buf.push(if v { NEWTRUE } else { NEWFALSE });
    }

    /// `MARK`: starts a variable-length group.
    pub fn mark(&mut self) {
        self.buf.push(MARK);
    }

    /// Closes a tuple of `n` items already on the stack (after `mark()` when `n > 3`) and memoizes
    /// it, as CPython does for non-empty tuples.
    pub fn tuple(&mut self, n: usize) {
        match n {
            0 => {
                self.buf.push(EMPTY_TUPLE);
                return;
            }
            1 => self.buf.push(TUPLE1),
            2 => self.buf.push(TUPLE2),
            3 => self.buf.push(TUPLE3),
            _ => self.buf.push(TUPLE),
        }
        self.put();
    }

    /// A tuple of ints (a shape or stride), memoized.
    pub fn int_tuple(&mut self, values: &[u64]) {
        if values.len() > 3 {
            self.mark();
        }
        for &v in values {
            self.int(v as i128);
        }
        self.tuple(values.len());
    }

    /// `EMPTY_TUPLE`.
    pub fn empty_tuple(&mut self) {
        self.buf.push(EMPTY_TUPLE);
    }
    /// `EMPTY_DICT`.
    pub fn empty_dict(&mut self) {
        self.buf.push(EMPTY_DICT);
    }
    /// `EMPTY_LIST`.
    pub fn empty_list(&mut self) {
        self.buf.push(EMPTY_LIST);
    }
    /// `SETITEMS`: the pairs since the last mark go into the dict below them.
    pub fn setitems(&mut self) {
        self.buf.push(SETITEMS);
    }
    /// `APPENDS`: the items since the last mark go into the list below them.
    pub fn appends(&mut self) {
        self.buf.push(APPENDS);
    }
    /// `BUILD`: applies the state on the stack to the object below it.
    pub fn build(&mut self) {
        self.buf.push(BUILD);
    }
    pub(crate) fn reduce(&mut self) {
        self.buf.push(REDUCE);
    }
    /// `NEWOBJ`: `cls.__new__(cls, *args)` of the class and argument tuple on the stack.
    pub fn newobj(&mut self) {
        self.buf.push(NEWOBJ);
    }
    pub(crate) fn binpersid(&mut self) {
        self.buf.push(BINPERSID);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int_bytes(v: i128) -> Vec<u8> {
        let mut p = Pickler::new(false);
        p.int(v);
        p.buf[2..].to_vec()
    }

    #[test]
    fn ints_use_cpython_opcodes() {
        assert_eq!(int_bytes(7), vec![BININT1, 7]);
        assert_eq!(int_bytes(1261), vec![BININT2, 0xed, 0x04]);
        assert_eq!(int_bytes(-1), vec![BININT, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(int_bytes(1 << 31), vec![LONG1, 5, 0, 0, 0, 0x80, 0]);
        assert_eq!(
            int_bytes(i64::MIN as i128),
            vec![LONG1, 8, 0, 0, 0, 0, 0, 0, 0, 0x80]
        );
        assert_eq!(
            int_bytes(u64::MAX as i128),
            vec![LONG1, 9, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0]
        );
    }

    #[test]
    fn reuse_emits_binget() {
        let mut p = Pickler::new(true);
        p.str("fqn");
        p.str("fqn");
        p.global("torch", "Size");
        p.global("torch", "Size");
        let b = p.finish();
        assert_eq!(&b[2..], b"X\x03\0\0\0fqnq\0h\0ctorch\nSize\nq\x01h\x01.");
    }
}
