//! A bounds-checked walk over Avro binary: every read either moves forward within the buffer or fails.

use crate::schema::Schema;
use pyo3::PyErr;
use std::convert::Infallible;

/// Why a datum could not be read.
pub enum Fail {
    /// It ends inside a value.
    Short,
    /// A string that is not UTF-8 (the decoder's words).
    Utf8(String),
    /// Anything else the bytes get wrong, in words.
    Bad(String),
    /// Python refused something (the node's class, an allocation).
    Python(PyErr),
}

impl From<PyErr> for Fail {
    fn from(error: PyErr) -> Self {
        Fail::Python(error)
    }
}

impl From<Infallible> for Fail {
    fn from(never: Infallible) -> Self {
        match never {}
    }
}

/// A block of an array or map: its item count, or (a negative count) its size in bytes for a reader that skips.
pub enum Block {
    Items(u64),
    Sized(u64, usize),
}

pub struct Cursor<'a> {
    buffer: &'a [u8],
    pub position: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(buffer: &'a [u8]) -> Self {
        Cursor { buffer, position: 0 }
    }

    fn left(&self) -> usize {
        self.buffer.len() - self.position
    }

    pub fn byte(&mut self) -> Result<u8, Fail> {
        let byte = *self.buffer.get(self.position).ok_or(Fail::Short)?;
        self.position += 1;
        Ok(byte)
    }

    pub fn take(&mut self, size: usize) -> Result<&'a [u8], Fail> {
        if size > self.left() {
            return Err(Fail::Short);
        }
        let start = self.position;
        self.position += size;
        Ok(&self.buffer[start..self.position])
    }

    /// A zigzag varint of at most 10 bytes whose value fits 64 bits (Avro's int and long).
    pub fn long(&mut self) -> Result<i64, Fail> {
        let mut result: u64 = 0;
        let mut shift = 0;
        loop {
            let byte = self.byte()?;
            if shift == 63 && byte > 1 {
                return Err(Fail::Bad("varint longer than 64 bits".into()));
            }
            result |= u64::from(byte & 0x7F) << shift;
            if byte < 0x80 {
                return Ok((result >> 1) as i64 ^ -((result & 1) as i64));
            }
            shift += 7;
        }
    }

    /// A length (of a string, bytes or a block) that may not be negative.
    pub fn length(&mut self) -> Result<usize, Fail> {
        let size = self.long()?;
        if size < 0 {
            return Err(Fail::Bad(format!("negative string length {size}")));
        }
        Ok(size as usize)
    }

    pub fn string(&mut self) -> Result<&'a str, Fail> {
        let size = self.length()?;
        let bytes = self.take(size)?;
        std::str::from_utf8(bytes).map_err(|e| Fail::Utf8(e.to_string()))
    }

    pub fn double(&mut self) -> Result<f64, Fail> {
        Ok(f64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    pub fn float(&mut self) -> Result<f64, Fail> {
        Ok(f64::from(f32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes"))))
    }

    /// A union's branch: one byte, as every writer of these schemas writes it.
    pub fn branch(&mut self, branches: usize) -> Result<usize, Fail> {
        let byte = self.byte()?;
        if byte & 0x81 != 0 || usize::from(byte >> 1) >= branches {
            return Err(Fail::Bad(format!("union branch byte {byte} does not name a branch")));
        }
        Ok(usize::from(byte >> 1))
    }

    pub fn enum_index(&mut self, symbols: usize) -> Result<usize, Fail> {
        let index = self.long()?;
        if index < 0 || index as u64 >= symbols as u64 {
            return Err(Fail::Bad(format!("enum index {index} does not exist")));
        }
        Ok(index as usize)
    }

    /// The next block's header; None at the array's end.
    pub fn block_header(&mut self) -> Result<Option<Block>, Fail> {
        let count = self.long()?;
        if count == 0 {
            return Ok(None);
        }
        if count < 0 {
            let size = self.long()?;
            if size < 0 {
                return Err(Fail::Bad(format!("negative block size {size}")));
            }
            return Ok(Some(Block::Sized(count.unsigned_abs(), size as usize)));
        }
        Ok(Some(Block::Items(count as u64)))
    }

    /// The next block's item count for a reader that walks every item (None at the end). Items take at least
    /// `item_size` bytes each (a count the bytes left cannot hold is malformed, before anything is read).
    pub fn block(&mut self, item_size: usize) -> Result<Option<u64>, Fail> {
        let count = match self.block_header()? {
            None => return Ok(None),
            Some(Block::Items(count) | Block::Sized(count, _)) => count,
        };
        let limit = if item_size == 0 { self.buffer.len() } else { self.left() / item_size };
        if count > limit as u64 {
            return Err(Fail::Bad(format!("a block of {count} items in {} bytes", self.left())));
        }
        Ok(Some(count))
    }

    fn skip_varints(&mut self, count: u64) -> Result<(), Fail> {
        if count > self.left() as u64 {
            return Err(Fail::Bad(format!("array of {count} ints in {} bytes", self.left())));
        }
        for _ in 0..count {
            let rest = &self.buffer[self.position..];
            let end = rest.iter().position(|b| *b < 0x80).ok_or_else(|| Fail::Bad("array of ints cut short".into()))?;
            self.position += end + 1;
        }
        Ok(())
    }

    /// An array of numbers kept encoded: its bytes, terminator included (None where a union holds null).
    pub fn raw_numbers(&mut self, schema: &Schema) -> Result<Option<&'a [u8]>, Fail> {
        let item_size = match schema {
            Schema::Null => return Ok(None),
            Schema::Union(branches) => {
                let branch = self.branch(branches.len())?;
                return self.raw_numbers(&branches[branch]);
            }
            Schema::Array(items) => match **items {
                Schema::Float => 4,
                Schema::Double => 8,
                _ => 0,
            },
            _ => unreachable!("the planner keeps only arrays of numbers encoded"),
        };
        let start = self.position;
        while let Some(block) = self.block_header()? {
            match block {
                Block::Sized(_, size) => {
                    self.take(size)?;
                }
                Block::Items(count) if item_size == 0 => self.skip_varints(count)?,
                Block::Items(count) => {
                    let size = count.checked_mul(item_size).filter(|s| *s <= self.left() as u64)
                        .ok_or_else(|| Fail::Bad("array runs past the end of the datum".into()))?;
                    self.take(size as usize)?;
                }
            }
        }
        Ok(Some(&self.buffer[start..self.position]))
    }

    /// Steps over a value; `checked`: its strings must still be UTF-8 (a field read and dropped).
    pub fn skip(&mut self, schema: &Schema, checked: bool) -> Result<(), Fail> {
        match schema {
            Schema::Null => {}
            Schema::Boolean => {
                self.byte()?;
            }
            Schema::Long => {
                self.long()?;
            }
            Schema::Float => {
                self.take(4)?;
            }
            Schema::Double => {
                self.take(8)?;
            }
            Schema::String if checked => {
                self.string()?;
            }
            Schema::String | Schema::Bytes => {
                let size = self.length()?;
                self.take(size)?;
            }
            Schema::Fixed(size) => {
                self.take(*size)?;
            }
            Schema::Enum(symbols) => {
                self.enum_index(symbols.len())?;
            }
            Schema::Union(branches) => {
                let branch = self.branch(branches.len())?;
                self.skip(&branches[branch], checked)?;
            }
            Schema::Array(_) | Schema::Map(_) if !checked => {
                let (items, keyed) = match schema {
                    Schema::Array(items) => (items, false),
                    Schema::Map(values) => (values, true),
                    _ => unreachable!(),
                };
                while let Some(block) = self.block_header()? {
                    match block {
                        Block::Sized(_, size) => {
                            self.take(size)?;
                        }
                        Block::Items(count) => self.skip_items(count, items, keyed, checked)?,
                    }
                }
            }
            Schema::Array(items) => {
                while let Some(count) = self.block(1)? {
                    self.skip_items(count, items, false, checked)?;
                }
            }
            Schema::Map(values) => {
                while let Some(count) = self.block(1)? {
                    self.skip_items(count, values, true, checked)?;
                }
            }
            Schema::Record(fields) => {
                for (_, field) in fields {
                    self.skip(field, checked)?;
                }
            }
            Schema::Span(plan) => {
                for field in &plan.fields {
                    match field {
                        crate::schema::SpanField::Value(_, s) | crate::schema::SpanField::Flag(s) => self.skip(s, checked)?,
                        crate::schema::SpanField::Tokens(_, s) => {
                            self.raw_numbers(s)?;
                        }
                        crate::schema::SpanField::Skip(s, inner) => self.skip(s, *inner && checked)?,
                    }
                }
            }
        }
        Ok(())
    }

    fn skip_items(&mut self, count: u64, items: &Schema, keyed: bool, checked: bool) -> Result<(), Fail> {
        if count > self.left() as u64 && (keyed || !matches!(items, Schema::Null)) {
            return Err(Fail::Bad(format!("a block of {count} items in {} bytes", self.left())));
        }
        for _ in 0..count {
            if keyed {
                self.skip(&Schema::String, checked)?;
            }
            self.skip(items, checked)?;
        }
        Ok(())
    }
}
