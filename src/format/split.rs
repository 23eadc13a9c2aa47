//! Splits a large pickle into item batches that decode in parallel (issue 27: every rank of a
//! resume parses a `.metadata` of millions of chunks, and the opcode decoder is sequential).
//!
//! A pickler writes a big list or dict as batches, `MARK item ... APPENDS` / `MARK key value ...
//! SETITEMS` (1,000 items each: `Lib/pickle.py` `_batch_appends`, `_batch_setitems`). A batch
//! cannot reach the stack below its MARK (`Modules/_pickle.c`'s fence), so it depends on what
//! comes before it only through the memo. [`plan`] walks the opcodes once without making any
//! value: it records where the batches are, how many memo keys each sets, and, for every memo key,
//! a [`Leaf`] when the value is an immutable leaf (str, int, bool, None, global). A batch is then
//! decoded apart (`unpickle::decode_batch`, its own builder, an empty list or dict standing in for
//! its container), and the rest of the pickle by one more decoder that skips the batches
//! (`unpickle::decode_skipping`). A memo reference that crosses into another part is answered from
//! the leaves; any other (a container, an object: Megatron's `all_local_plans` refers to the
//! chunks of `state_dict_metadata`) becomes a placeholder that is followed on read (the
//! parts are never merged) to the value that the part setting it hands over (each part hands over
//! its memo keys that are read anywhere). A
//! builder refuses a placeholder wherever it would have to look inside it; the part then fails,
//! and the caller decodes the whole pickle sequentially, which stays the reference for every
//! result and every error.
//!
//! The plan is refused (None) for anything a pickler does not write: memo keys set out of order
//! or twice, a reference to a key never set, unknown opcodes, a stack underflow. Those inputs
//! decode sequentially and get the sequential decoder's error.

/// A memo value that a part decoded apart may take from outside itself, packed in a `u64`: the
/// tag in the low 3 bits. Strings are positions in the input (not yet checked as UTF-8: the
/// decoder that owns the string's opcode checks it, and so does [`Plan::leaf`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaf {
    /// Anything else (a container, an object, a call, bytes, a float): not shareable.
    Opaque,
    /// `None`.
    None,
    /// A bool.
    Bool(bool),
    /// An int that fits in 64 bits.
    Int(i64),
    /// A string, not yet checked as UTF-8.
    Str {
        /// Its byte offset in the input.
        at: u32,
        /// Its length in bytes.
        len: u32,
    },
    /// Index into [`Plan`]'s globals.
    Global(u32),
    /// The dict made by the `EMPTY_DICT`/`DICT` opcode at this position (never shared: tracked
    /// so that a batch of a dict that `BUILD` takes as an object's state is not decoded apart).
    Dict(u32),
}

const OPAQUE: u64 = 0;
const T_NONE: u64 = 1;
const T_BOOL: u64 = 2;
const T_INT: u64 = 3;
const T_STR: u64 = 4;
const T_GLOBAL: u64 = 5;
const T_DICT: u64 = 6;

impl Leaf {
    fn pack(self) -> u64 {
        match self {
            Leaf::Opaque => OPAQUE,
            Leaf::None => T_NONE,
            Leaf::Bool(b) => T_BOOL | (b as u64) << 3,
            Leaf::Int(i) => T_INT | (i << 3) as u64,
            Leaf::Str { at, len } => T_STR | (at as u64) << 3 | (len as u64) << 35,
            Leaf::Global(g) => T_GLOBAL | (g as u64) << 3,
            Leaf::Dict(at) => T_DICT | (at as u64) << 3,
        }
    }
    fn unpack(x: u64) -> Leaf {
        match x & 7 {
            T_NONE => Leaf::None,
            T_BOOL => Leaf::Bool(x >> 3 != 0),
            T_INT => Leaf::Int(x as i64 >> 3),
            T_STR => Leaf::Str {
                at: (x >> 3) as u32,
                len: (x >> 35) as u32,
            },
            T_GLOBAL => Leaf::Global((x >> 3) as u32),
            T_DICT => Leaf::Dict((x >> 3) as u32),
            _ => Leaf::Opaque,
        }
    }
    /// An int that survives the 3-bit tag, else opaque.
    fn int(i: i128) -> u64 {
        match i64::try_from(i) {
            Ok(v) if (-(1 << 60)..(1 << 60)).contains(&v) => Leaf::Int(v).pack(),
            _ => OPAQUE,
        }
    }
}

/// A batch: the bytes `start..end` (its `MARK` through its `APPENDS`/`SETITEMS`), the memo keys
/// `memo_base..memo_base + memo_len` it sets, and whether its container is a dict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batch {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) memo_base: u32,
    pub(crate) memo_len: u32,
    pub(crate) dict: bool,
}

/// Which batches to decode apart: each at least `min_bytes` and at most `max_bytes` long, never
/// one of a dict that `BUILD` takes as an object's state (its object is filled from all its items
/// at once). Of two nested batches the inner ones are chosen when they hold at least half of the
/// outer one's bytes (more parts to decode in parallel), else the outer one.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub(crate) min_bytes: usize,
    pub(crate) max_bytes: usize,
}

impl Sizes {
    /// For `.metadata`: torch's batches are 1,000 items (about 100-200 KiB of chunks or storage
    /// entries); smaller ones are not worth a part, larger ones are split by their own batches.
    pub const METADATA: Sizes = Sizes {
        min_bytes: 16 << 10,
        max_bytes: 1 << 20,
    };
}

/// What [`plan`] found: the batches, in input order, each memo key's [`Leaf`], and which keys
/// are ever read.
pub struct Plan<'a> {
    input: &'a [u8],
    memo: Vec<u64>,
    /// Bit `i`: memo key `i` is read by a `GET` somewhere.
    read: Vec<u64>,
    globals: Vec<(&'a [u8], &'a [u8])>,
    /// The batches the value stream is cut into, in input order.
    pub batches: Vec<Batch>,
}

impl<'a> Plan<'a> {
    /// Whether a part must hand over the value of its memo key `idx` after decoding (another
    /// part may refer to it): a key that is read and is not a leaf.
    pub fn exported(&self, idx: usize) -> bool {
        self.read
            .get(idx / 64)
            .is_some_and(|w| w >> (idx % 64) & 1 != 0)
            && self
                .memo
                .get(idx)
                .is_some_and(|&m| matches!(Leaf::unpack(m), Leaf::Opaque | Leaf::Dict(_)))
    }

    /// What memo key `idx` holds, if a part decoded apart may take it: the string's bytes are
    /// checked as UTF-8 here.
    pub fn leaf(&self, idx: u32) -> Option<LeafValue<'a>> {
        let packed = *self.memo.get(idx as usize)?;
        let text = |b: &'a [u8]| std::str::from_utf8(b).ok();
        Some(match Leaf::unpack(packed) {
            Leaf::Opaque | Leaf::Dict(_) => return None,
            Leaf::None => LeafValue::None,
            Leaf::Bool(b) => LeafValue::Bool(b),
            Leaf::Int(i) => LeafValue::Int(i),
            Leaf::Str { at, len } => LeafValue::Str(text(
                self.input.get(at as usize..at as usize + len as usize)?,
            )?),
            Leaf::Global(g) => {
                let (m, n) = *self.globals.get(g as usize)?;
                LeafValue::Global(text(m)?, text(n)?)
            }
        })
    }
}

/// A [`Leaf`] resolved against the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeafValue<'a> {
    /// `None`.
    None,
    /// A bool.
    Bool(bool),
    /// An int.
    Int(i64),
    /// A string.
    Str(&'a str),
    /// A global: module and name.
    Global(&'a str, &'a str),
}

/// The opcode walk: a stack of packed [`Leaf`]s, the open MARKs (stack height, byte position,
/// memo count), and the memo.
struct Scan<'a> {
    input: &'a [u8],
    pos: usize,
    stack: Vec<u64>,
    marks: Vec<(usize, usize, u32)>,
    memo: Vec<u64>,
    read: Vec<u64>,
    globals: Vec<(&'a [u8], &'a [u8])>,
    /// Every batch of a fitting size, as it closes (inner ones first), with its container and
    /// whether `BUILD` then took that container as an object's state.
    found: Vec<(Batch, u64, bool)>,
    sizes: Sizes,
}

impl<'a> Scan<'a> {
    #[inline]
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.input.len() - self.pos {
            return None;
        }
        let s = &self.input[self.pos..self.pos + n];
        self.pos += n;
        Some(s)
    }
    #[inline]
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    #[inline]
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn line(&mut self) -> Option<&'a [u8]> {
        let rest = &self.input[self.pos..];
        let n = rest.iter().position(|&b| b == b'\n')?;
        self.pos += n + 1;
        Some(&rest[..n])
    }
    #[inline]
    fn fence(&self) -> usize {
        self.marks.last().map_or(0, |m| m.0)
    }
    #[inline]
    fn pop(&mut self) -> Option<u64> {
        if self.stack.len() <= self.fence() {
            return None;
        }
        self.stack.pop()
    }
    #[inline]
    fn pop_n(&mut self, n: usize) -> Option<()> {
        if self.stack.len() < self.fence() + n {
            return None;
        }
        self.stack.truncate(self.stack.len() - n);
        Some(())
    }
    #[inline]
    fn top(&self) -> Option<u64> {
        (self.stack.len() > self.fence()).then(|| *self.stack.last().unwrap_or(&OPAQUE))
    }
    /// Closes the last MARK, dropping the values above it.
    fn pop_mark(&mut self) -> Option<(usize, usize, u32)> {
        let m = self.marks.pop()?;
        self.stack.truncate(m.0);
        Some(m)
    }
    fn put(&mut self, idx: u32) -> Option<()> {
        // Only the order every pickler writes: key `len(memo)`, once.
        if idx as usize != self.memo.len() {
            return None;
        }
        let v = self.top()?;
        self.memo.push(v);
        Some(())
    }
    fn get(&mut self, idx: u32) -> Option<()> {
        let i = idx as usize;
        let v = *self.memo.get(i)?;
        if self.read.len() <= i / 64 {
            self.read.resize(self.memo.len() / 64 + 1, 0);
        }
        self.read[i / 64] |= 1 << (i % 64);
        self.stack.push(v);
        Some(())
    }
    fn str_leaf(&self, s: &'a [u8]) -> u64 {
        let at = s.as_ptr() as usize - self.input.as_ptr() as usize;
        match (u32::try_from(at), u32::try_from(s.len())) {
            (Ok(at), Ok(len)) if len < 1 << 29 => Leaf::Str { at, len }.pack(),
            _ => OPAQUE,
        }
    }
    fn global(&mut self, m: &'a [u8], n: &'a [u8]) -> u64 {
        match u32::try_from(self.globals.len()) {
            Ok(g) if g < 1 << 28 => {
                self.globals.push((m, n));
                Leaf::Global(g).pack()
            }
            _ => OPAQUE,
        }
    }
    /// A batch closed by `APPENDS`/`SETITEMS` at the current position: noted when its size fits.
    fn batch(&mut self, (height, start, memo_base): (usize, usize, u32), dict: bool) -> Option<()> {
        // The container is the value below the MARK, above the enclosing fence (checked again
        // by the decoder that skips the batch).
        if height <= self.fence() {
            return None;
        }
        let size = self.pos - start;
        if size >= self.sizes.min_bytes && size <= self.sizes.max_bytes {
            let batch = Batch {
                start,
                end: self.pos,
                memo_base,
                memo_len: self.memo.len() as u32 - memo_base,
                dict,
            };
            self.found.push((batch, self.stack[height - 1], false));
        }
        Some(())
    }

    /// The batches to decode apart (see [`Sizes`]).
    fn choose(self) -> Vec<Batch> {
        let mut out: Vec<Batch> = Vec::new();
        // `found` is in closing order, so a batch comes after the batches inside it, which are
        // the last ones chosen so far.
        for (batch, _, state) in self.found {
            if state {
                continue;
            }
            let inner = out.len()
                - out
                    .iter()
                    .rev()
                    .take_while(|b| b.start > batch.start)
                    .count();
            let covered: usize = out[inner..].iter().map(|b| b.end - b.start).sum();
            if covered * 2 < batch.end - batch.start {
                out.truncate(inner);
                out.push(batch);
            }
        }
        out
    }

    /// The walk, mirroring `unpickle::Vm::run` opcode for opcode; None where that decoder would
    /// fail or where a pickler would not write what is there.
    fn run(&mut self) -> Option<()> {
        loop {
            let at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    self.u8()?;
                }
                0x95 => {
                    self.u64()?;
                }
                b'.' => return self.pop().map(|_| ()),
                b'(' => {
                    let memo = u32::try_from(self.memo.len()).ok()?;
                    self.marks.push((self.stack.len(), at, memo));
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?;
                    self.stack.push(v);
                }
                b'N' => self.stack.push(Leaf::None.pack()),
                0x88 | 0x89 => self.stack.push(Leaf::Bool(op == 0x88).pack()),
                b'J' => {
                    let v = i32::from_le_bytes(self.take(4)?.try_into().ok()?);
                    self.stack.push(Leaf::int(v as i128));
                }
                b'K' => {
                    let v = self.u8()?;
                    self.stack.push(Leaf::int(v as i128));
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.take(2)?.try_into().ok()?);
                    self.stack.push(Leaf::int(v as i128));
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a {
                        self.u8()? as usize
                    } else {
                        self.u32()? as usize
                    };
                    let b = self.take(n)?;
                    let v = if n <= 8 {
                        let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) {
                            0xff
                        } else {
                            0
                        };
                        let mut buf = [fill; 8];
                        buf[..n].copy_from_slice(b);
                        Leaf::int(i64::from_le_bytes(buf) as i128)
                    } else {
                        OPAQUE
                    };
                    self.stack.push(v);
                }
                // Text-mode numbers, floats: never shared (a reference to one fails the part).
                b'I' | b'L' | b'F' | b'V' | b'S' => {
                    self.line()?;
                    self.stack.push(OPAQUE);
                }
                b'G' => {
                    self.take(8)?;
                    self.stack.push(OPAQUE);
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        0x8c => self.u8()? as usize,
                        b'X' => self.u32()? as usize,
                        _ => usize::try_from(self.u64()?).ok()?,
                    };
                    let s = self.take(n)?;
                    let v = self.str_leaf(s);
                    self.stack.push(v);
                }
                b'U' | b'T' | b'C' | b'B' | 0x8e | 0x96 => {
                    let n = match op {
                        b'U' | b'C' => self.u8()? as usize,
                        b'T' | b'B' => self.u32()? as usize,
                        _ => usize::try_from(self.u64()?).ok()?,
                    };
                    self.take(n)?;
                    self.stack.push(OPAQUE);
                }
                b')' | b']' | 0x8f => self.stack.push(OPAQUE),
                b'}' => self.stack.push(Leaf::Dict(at as u32).pack()),
                b't' | 0x91 | b'l' => {
                    self.pop_mark()?;
                    self.stack.push(OPAQUE);
                }
                b'd' => {
                    self.pop_mark()?;
                    self.stack.push(Leaf::Dict(at as u32).pack());
                }
                0x85..=0x87 => {
                    self.pop_n((op - 0x84) as usize)?;
                    self.stack.push(OPAQUE);
                }
                b'a' => {
                    if self.stack.len() < self.fence() + 2 {
                        return None;
                    }
                    self.stack.pop();
                }
                b's' => {
                    if self.stack.len() < self.fence() + 3 {
                        return None;
                    }
                    self.pop_n(2)?;
                }
                b'e' | b'u' => {
                    let m = self.pop_mark()?;
                    self.batch(m, op == b'u')?;
                }
                0x90 => {
                    self.pop_mark()?;
                }
                b'p' => {
                    let idx = std::str::from_utf8(self.line()?).ok()?.parse().ok()?;
                    self.put(idx)?;
                }
                b'q' => {
                    let idx = self.u8()? as u32;
                    self.put(idx)?;
                }
                b'r' => {
                    let idx = self.u32()?;
                    self.put(idx)?;
                }
                0x94 => {
                    let idx = u32::try_from(self.memo.len()).ok()?;
                    self.put(idx)?;
                }
                b'g' => {
                    let idx = std::str::from_utf8(self.line()?).ok()?.parse().ok()?;
                    self.get(idx)?;
                }
                b'h' => {
                    let idx = self.u8()? as u32;
                    self.get(idx)?;
                }
                b'j' => {
                    let idx = self.u32()?;
                    self.get(idx)?;
                }
                b'c' => {
                    let m = self.line()?;
                    let n = self.line()?;
                    let v = self.global(m, n);
                    self.stack.push(v);
                }
                0x93 => {
                    let name = Leaf::unpack(self.pop()?);
                    let module = Leaf::unpack(self.pop()?);
                    let v = match (module, name) {
                        (Leaf::Str { at: ma, len: ml }, Leaf::Str { at: na, len: nl }) => {
                            let m = &self.input[ma as usize..ma as usize + ml as usize];
                            let n = &self.input[na as usize..na as usize + nl as usize];
                            self.global(m, n)
                        }
                        // Not two strings: the decoder fails there.
                        _ => return None,
                    };
                    self.stack.push(v);
                }
                b'R' | 0x81 => {
                    self.pop_n(2)?;
                    self.stack.push(OPAQUE);
                }
                b'b' => {
                    let state = self.pop()?;
                    // A state dict is built right before its BUILD (`MARK ... SETITEMS BUILD`), so
                    // only the last batch found is looked at. One missed (a state of more than
                    // one batch) fails the split decode (`Build` refuses a state holding a
                    // splice), which then runs sequentially: slower, never different.
                    if let Some(f) = self.found.last_mut() {
                        if matches!(Leaf::unpack(state), Leaf::Dict(_)) && f.1 == state {
                            f.2 = true;
                        }
                    }
                    self.pop()?;
                    self.stack.push(OPAQUE);
                }
                0x92 => {
                    self.pop_n(3)?;
                    self.stack.push(OPAQUE);
                }
                b'Q' => {
                    self.pop()?;
                    self.stack.push(OPAQUE);
                }
                b'P' => {
                    self.line()?;
                    self.stack.push(OPAQUE);
                }
                0x97 => {}
                _ => return None,
            }
        }
    }
}

/// Walks `input` once and returns where its batches of `sizes` are, or None when the pickle is
/// not one to split (see the module doc). Costs one pass over the opcodes and 8 bytes per memo
/// key; makes no value.
pub fn plan(input: &[u8], sizes: Sizes) -> Option<Plan<'_>> {
    // Positions are kept in 32 bits.
    if input.len() > u32::MAX as usize {
        return None;
    }
    let mut s = Scan {
        input,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        // About one memo key per 12 input bytes in torch's pickles: reserved up front so that the
        // memo is not copied as it grows (untouched pages of an over-estimate cost no memory).
        memo: super::reserved(input.len() / 8),
        read: Vec::new(),
        globals: Vec::new(),
        found: Vec::new(),
        sizes,
    };
    s.run()?;
    let memo = std::mem::take(&mut s.memo);
    let read = std::mem::take(&mut s.read);
    let globals = std::mem::take(&mut s.globals);
    Some(Plan {
        input,
        memo,
        read,
        globals,
        batches: s.choose(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaves_pack_and_unpack() {
        for l in [
            Leaf::Opaque,
            Leaf::None,
            Leaf::Bool(true),
            Leaf::Bool(false),
            Leaf::Int(-5),
            Leaf::Int((1 << 60) - 1),
            Leaf::Int(-(1 << 60)),
            Leaf::Str {
                at: u32::MAX,
                len: (1 << 29) - 1,
            },
            Leaf::Global(7),
            Leaf::Dict(u32::MAX),
        ] {
            assert_eq!(Leaf::unpack(l.pack()), l);
        }
        assert_eq!(Leaf::int(1 << 61), OPAQUE);
    }
}
